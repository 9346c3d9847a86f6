#!/usr/bin/env bash
# Test perplexity of a LION LM with fairseq-eval-lm, in any --lion-form of the checkpoint.
#   bash user_dir_examples/lm/eval.sh DATA_BIN CHECKPOINT [extra fairseq-eval-lm options]
# Environment: FORM [checkpoint's] (parallel | chunk | recurrent)   SUBSET [test]
#   TOKENS_PER_SAMPLE [512]   CONTEXT_WINDOW [400: each block scored with 400 tokens of context]   BATCH_SIZE [2]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 2 ] || die "usage: [FORM=recurrent ...] bash $0 DATA_BIN CHECKPOINT [fairseq-eval-lm options]"
DATA=$1; CKPT=$2; shift 2
[ -f "$CKPT" ] || die "CHECKPOINT $CKPT not found"
need fairseq-eval-lm
OVERRIDES=()
if [ -n "${FORM:-}" ]; then OVERRIDES=(--model-overrides "{'lion_form': '$FORM'}"); fi
# --user-dir is needed here too: fairseq imports it only from the command line, not from the checkpoint
run fairseq-eval-lm "$DATA" --user-dir "$USER_DIR" --path "$CKPT" --gen-subset "${SUBSET:-test}" \
  --tokens-per-sample "${TOKENS_PER_SAMPLE:-512}" --context-window "${CONTEXT_WINDOW:-400}" \
  --batch-size "${BATCH_SIZE:-2}" ${OVERRIDES[@]+"${OVERRIDES[@]}"} "$@"
