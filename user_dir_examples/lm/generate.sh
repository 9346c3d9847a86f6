#!/usr/bin/env bash
# Continue prompts (one per line on stdin) with a LION LM through fairseq-interactive: fairseq's
# SequenceGenerator with incremental (recurrent) decoding, O(1) work per generated token.
#   echo "the history of" | bash user_dir_examples/lm/generate.sh DATA_BIN CHECKPOINT [extra options]
# Environment: BEAM [1]   SAMPLING [1: top-k sampling; 0: beam search]   TOPK [10]   SEED [1]
#   MAX_LEN [50]: new tokens after each prompt. fairseq's --max-len-b counts the prompt in (a prompt longer
#   than it comes back cut, with nothing generated); its limit is max-len-a x source + max-len-b, the source
#   being the prompt and a </s>, so --max-len-a 1 --max-len-b MAX_LEN-1 asks for MAX_LEN new tokens. The limit
#   is one per batch: keep fairseq-interactive's default of one prompt a batch (--batch-size 1).
#   Subword data from preprocess.text: encoded with DATA_BIN/sentencepiece.bpe.model (another: pass --bpe ...)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 2 ] || die "usage: echo PROMPT | bash $0 DATA_BIN CHECKPOINT [fairseq-interactive options]"
DATA=$1; CKPT=$2; shift 2
[ -f "$CKPT" ] || die "CHECKPOINT $CKPT not found"
need fairseq-interactive
MAX_LEN=${MAX_LEN:-50}
whole MAX_LEN 0 "the number of new tokens"
SAMPLE=()
if [ "${SAMPLING:-1}" = 1 ]; then SAMPLE=(--sampling --sampling-topk "${TOPK:-10}"); fi
run fairseq-interactive "$DATA" --user-dir "$USER_DIR" --task language_modeling --path "$CKPT" \
  --beam "${BEAM:-1}" ${SAMPLE[@]+"${SAMPLE[@]}"} --max-len-a 1 --max-len-b $(( MAX_LEN - 1 )) --seed "${SEED:-1}" "$@"
