#!/usr/bin/env bash
# Continue prompts (one per line on stdin) with a LION LM through fairseq-interactive: fairseq's
# SequenceGenerator with incremental (recurrent) decoding, O(1) work per generated token.
#   echo "the history of" | bash user_dir_examples/lm/generate.sh DATA_BIN CHECKPOINT [extra options]
# Environment: BEAM [1]   SAMPLING [1: top-k sampling; 0: beam search]   TOPK [10]   MAX_LEN [50 tokens]
#   For subword data add: --bpe sentencepiece --sentencepiece-model DATA_BIN/sentencepiece.bpe.model
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 2 ] || die "usage: echo PROMPT | bash $0 DATA_BIN CHECKPOINT [fairseq-interactive options]"
DATA=$1; CKPT=$2; shift 2
[ -f "$CKPT" ] || die "CHECKPOINT $CKPT not found"
need fairseq-interactive
SAMPLE=()
if [ "${SAMPLING:-1}" = 1 ]; then SAMPLE=(--sampling --sampling-topk "${TOPK:-10}"); fi
run fairseq-interactive "$DATA" --user-dir "$USER_DIR" --task language_modeling --path "$CKPT" \
  --beam "${BEAM:-1}" ${SAMPLE[@]+"${SAMPLE[@]}"} --max-len-b "${MAX_LEN:-50}" --seed "${SEED:-1}" "$@"
