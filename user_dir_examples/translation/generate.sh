#!/usr/bin/env bash
# Translate the test split with beam search and print BLEU, as fairseq's IWSLT recipe does.
#   bash user_dir_examples/translation/generate.sh DATA_BIN CHECKPOINT [extra fairseq-generate options]
# (--required-batch-size-multiple 1: the default, 8, silently drops sentences of the last batch, fairseq #5036)
# Environment: BEAM [5]   LION_FORM [as trained; recurrent gives the same]   REMOVE_BPE [1]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 2 ] || die "usage: bash $0 DATA_BIN CHECKPOINT [fairseq-generate options]"
DATA=$1; CKPT=$2; shift 2
[ -f "$CKPT" ] || die "no checkpoint $CKPT"
need fairseq-generate
EXTRA=()
if [ -n "${LION_FORM:-}" ]; then
  lion_form_setting LION_FORM
  EXTRA+=(--model-overrides "{'lion_form': '$LION_FORM'}")
fi
[ "${REMOVE_BPE:-1}" = 1 ] && EXTRA+=(--remove-bpe)
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || EXTRA+=(--cpu)
run fairseq-generate "$DATA" --user-dir "$USER_DIR" --path "$CKPT" --gen-subset test \
  --batch-size 128 --required-batch-size-multiple 1 --beam "${BEAM:-5}" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
