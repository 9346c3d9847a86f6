#!/usr/bin/env bash
# Causal LION language model, fairseq's transformer_lm recipe for WikiText-103 with a LION arch.
#   bash user_dir_examples/lm/train.sh DATA_BIN SAVE_DIR [extra fairseq-train options]
# Environment (defaults in brackets):
#   ARCH [lion_s_lm]  lion_s_lm | lion_d_lm | lion_retnet_lm | lion_lit_lm, *_lm_tiny, lion_s_lm_plus[_tiny]
#   LR [5e-4]   MAX_UPDATE [50000]   TOKENS_PER_SAMPLE [512]
#   WARMUP_UPDATES [4000, or the same share of a shorter MAX_UPDATE]
#   MAX_TOKENS [2048 per GPU]   UPDATE_FREQ [32: 65536 tokens per update on 1 GPU, upstream's 2 GPUs x 16]
#   LION_FORM [chunk]   LION_CHUNK_SIZE [64]   PRECISION [fp16 on GPU, fp32 on CPU]   LOG_INTERVAL [100]   SEED [1]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 2 ] || die "usage: [ARCH=lion_s_lm ...] bash $0 DATA_BIN SAVE_DIR [fairseq-train options]"
DATA=$1; SAVE=$2; shift 2
[ -f "$DATA/dict.txt" ] || die "DATA_BIN $DATA has no dict.txt: make it with prepare.sh"
need fairseq-train
ARCH=${ARCH:-lion_s_lm}
lm_arch "$ARCH"
MAX_UPDATE=${MAX_UPDATE:-50000}
whole MAX_UPDATE
WARMUP_UPDATES=${WARMUP_UPDATES:-$(warmup_share "$MAX_UPDATE" 4000 50000)}
PFLAGS=$(precision_flags "$@") || exit 2

# --required-batch-size-multiple 1: fairseq's default (8) silently drops a last batch of another size,
# from the validation set too (fairseq issue #5036)
run fairseq-train "$DATA" --user-dir "$USER_DIR" \
  --task language_modeling --criterion cross_entropy --arch "$ARCH" \
  --lion-form "${LION_FORM:-chunk}" --lion-chunk-size "${LION_CHUNK_SIZE:-64}" \
  --share-decoder-input-output-embed --dropout 0.1 \
  --optimizer adam --adam-betas "(0.9, 0.98)" --weight-decay 0.01 --clip-norm 0.0 \
  --lr "${LR:-5e-4}" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP_UPDATES" --warmup-init-lr 1e-07 \
  --tokens-per-sample "${TOKENS_PER_SAMPLE:-512}" --sample-break-mode none \
  --max-tokens "${MAX_TOKENS:-2048}" --update-freq "${UPDATE_FREQ:-32}" --required-batch-size-multiple 1 \
  --max-update "$MAX_UPDATE" --seed "${SEED:-1}" \
  --save-dir "$SAVE" --no-epoch-checkpoints --tensorboard-logdir "$SAVE/tensorboard" \
  --log-format json --log-interval "${LOG_INTERVAL:-100}" $PFLAGS "$@"
