#!/usr/bin/env bash
# GLUE task TSVs -> the input0/ input1/ label/ layout of sentence_prediction, tokenised with the
# sentencepiece model and dict.txt of the pretraining data (so ids match the checkpoint).
#   bash user_dir_examples/glue/prepare.sh TASK GLUE_TASK_DIR PRETRAIN_DATA_BIN DEST_DIR
# TASK: CoLA SST-2 MRPC QQP STS-B MNLI QNLI RTE WNLI (the folder names of GLUE's download).
# Uses train.tsv and dev.tsv (MNLI: dev_matched.tsv); GLUE's test sets have no labels. Environment: WORKERS [4]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -eq 4 ] || die "usage: bash $0 TASK GLUE_TASK_DIR PRETRAIN_DATA_BIN DEST_DIR"
TASK=$1; DIR=$2; PRE=$3; DEST=$4
DEV=dev.tsv
EXTRA=()
# columns: header names, or 0-based indices for CoLA (no header) and MRPC (names with spaces)
case "$TASK" in
  CoLA)  COLUMNS=3,1; EXTRA=(--no-header) ;;
  SST-2) COLUMNS=sentence,label ;;
  MRPC)  COLUMNS=3,4,0 ;;
  QQP)   COLUMNS=question1,question2,is_duplicate; EXTRA=(--skip-bad-rows) ;;
  STS-B) COLUMNS=sentence1,sentence2,score; EXTRA=(--regression --label-divisor 5) ;;  # 0-5 to 0-1, as fairseq's
  MNLI)  COLUMNS=sentence1,sentence2,gold_label; DEV=dev_matched.tsv ;;
  QNLI)  COLUMNS=question,sentence,label ;;
  RTE|WNLI) COLUMNS=sentence1,sentence2,label ;;
  *) die "unknown TASK '$TASK': one of CoLA SST-2 MRPC QQP STS-B MNLI QNLI RTE WNLI" ;;
esac
for f in "$DIR/train.tsv" "$DIR/$DEV" "$PRE/sentencepiece.bpe.model" "$PRE/dict.txt"; do
  [ -f "$f" ] || die "missing $f"
done
# an earlier run's output is replaced; any other non-empty folder is left alone (a swapped argument must
# not delete the pretraining data or the GLUE download)
FORCE=()
if [ -f "$DEST/preprocess.json" ] && [ -d "$DEST/input0" ]; then
  FORCE=(--force)
elif [ -d "$DEST" ] && [ -n "$(ls -A "$DEST")" ]; then
  die "DEST_DIR $DEST exists and is not an earlier output of this script: remove it or name a new folder"
fi
# the checkout's preprocess/ first (a pip-installed lion-fairseq has it too)
PYTHONPATH="$RECIPES_ROOT${PYTHONPATH:+:$PYTHONPATH}" run python -m preprocess.glue \
  --train "$DIR/train.tsv" --dev "$DIR/$DEV" --spm "$PRE/sentencepiece.bpe.model" --dict "$PRE/dict.txt" \
  --columns "$COLUMNS" ${EXTRA[@]+"${EXTRA[@]}"} --destdir "$DEST" --workers "${WORKERS:-4}" ${FORCE[@]+"${FORCE[@]}"}
