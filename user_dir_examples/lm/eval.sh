#!/usr/bin/env bash
# Test perplexity of a LION LM with fairseq-eval-lm, in any --lion-form of the checkpoint.
#   bash user_dir_examples/lm/eval.sh DATA_BIN CHECKPOINT [extra fairseq-eval-lm options]
# Environment: FORM [checkpoint's] (parallel | chunk | recurrent)   SUBSET [test]
#   TOKENS_PER_SAMPLE [512]   CONTEXT_WINDOW [25/32 of it: 400 at 512; the tokens of context each scored
#   block gets, fewer than TOKENS_PER_SAMPLE]   BATCH_SIZE [2]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 2 ] || die "usage: [FORM=recurrent ...] bash $0 DATA_BIN CHECKPOINT [fairseq-eval-lm options]"
DATA=$1; CKPT=$2; shift 2
[ -f "$CKPT" ] || die "CHECKPOINT $CKPT not found"
need fairseq-eval-lm
for a in "$@"; do  # passed on, one would meet the other's default (400 of context at 64 tokens, say)
  case "$a" in
    --tokens-per-sample|--tokens-per-sample=*|--context-window|--context-window=*)
      die "$a: set TOKENS_PER_SAMPLE= and CONTEXT_WINDOW= instead, which this script derives and checks together" ;;
  esac
done
TPS=${TOKENS_PER_SAMPLE:-512}
[[ "$TPS" =~ ^[1-9][0-9]*$ ]] || die "TOKENS_PER_SAMPLE must be a positive whole number, got '$TPS'"
WINDOW=${CONTEXT_WINDOW:-$((TPS * 25 / 32))}
[[ "$WINDOW" =~ ^[0-9]+$ ]] && [ "$WINDOW" -lt "$TPS" ] || die "CONTEXT_WINDOW ($WINDOW) must be a whole number \
below TOKENS_PER_SAMPLE ($TPS): each block of TOKENS_PER_SAMPLE tokens scores the tokens after its CONTEXT_WINDOW \
tokens of context; lower CONTEXT_WINDOW, or leave it unset for 25/32 of TOKENS_PER_SAMPLE"
OVERRIDES=()
if [ -n "${FORM:-}" ]; then lion_form_setting FORM; OVERRIDES=(--model-overrides "{'lion_form': '$FORM'}"); fi
# --user-dir is needed here too: fairseq imports it only from the command line, not from the checkpoint
run fairseq-eval-lm "$DATA" --user-dir "$USER_DIR" --path "$CKPT" --gen-subset "${SUBSET:-test}" \
  --tokens-per-sample "$TPS" --context-window "$WINDOW" \
  --batch-size "${BATCH_SIZE:-2}" ${OVERRIDES[@]+"${OVERRIDES[@]}"} "$@"
