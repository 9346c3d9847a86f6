#!/usr/bin/env bash
# WikiText-103 (or any corpus in its layout: wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens,
# already word-tokenised) -> word-level fairseq binaries, as fairseq's own language-model recipe.
#   bash user_dir_examples/lm/prepare.sh WIKITEXT_DIR DEST_DIR
# For subword data instead, use python -m preprocess.text (see README.md). Environment: WORKERS [8]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -eq 2 ] || die "usage: bash $0 WIKITEXT_DIR DEST_DIR"
DIR=$1; DEST=$2
for split in train valid test; do
  [ -s "$DIR/wiki.$split.tokens" ] || die "missing or empty $DIR/wiki.$split.tokens"
done
[ ! -e "$DEST/dict.txt" ] || die "DEST_DIR $DEST holds an earlier output (dict.txt): remove it, or pass another folder"
need fairseq-preprocess
run fairseq-preprocess --only-source \
  --trainpref "$DIR/wiki.train.tokens" --validpref "$DIR/wiki.valid.tokens" --testpref "$DIR/wiki.test.tokens" \
  --destdir "$DEST" --workers "${WORKERS:-8}"
