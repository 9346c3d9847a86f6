#!/usr/bin/env bash
# IWSLT'14 German-English in the layout of fairseq's examples/translation/prepare-iwslt14.sh (its output
# folder iwslt14.tokenized.de-en: train.de train.en valid.de valid.en test.de test.en, tokenised and BPE'd)
# -> fairseq binaries, as fairseq's own recipe makes them.
#   bash user_dir_examples/translation/prepare.sh IWSLT_DIR DEST_DIR
# Environment: SRC [de]  TGT [en]  WORKERS [8]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -eq 2 ] || die "usage: bash $0 IWSLT_DIR DEST_DIR"
DIR=$1; DEST=$2; SRC=${SRC:-de}; TGT=${TGT:-en}
for split in train valid test; do
  for lang in "$SRC" "$TGT"; do
    [ -s "$DIR/$split.$lang" ] || die "missing or empty $DIR/$split.$lang (run fairseq's prepare-iwslt14.sh first)"
  done
done
[ ! -e "$DEST/dict.$SRC.txt" ] || die "DEST_DIR $DEST holds an earlier output (dict.$SRC.txt): remove it, or pass another folder"
need fairseq-preprocess
run fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
  --trainpref "$DIR/train" --validpref "$DIR/valid" --testpref "$DIR/test" \
  --destdir "$DEST" --workers "${WORKERS:-8}"
