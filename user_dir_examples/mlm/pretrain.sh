#!/usr/bin/env bash
# MLM pretraining of a LION encoder in the paper's BERT setting (see README.md beside this file).
#   bash user_dir_examples/mlm/pretrain.sh DATA_BIN SAVE_DIR [extra fairseq-train options]
# Settings come from the environment (defaults in brackets):
#   ARCH [lion_s]  lion_s | lion_d | lion_lit (| lion_retnet), *_large, *_tiny
#   LR [8e-4, or 2e-4 for *_large]   END_LR [LR x 0.02]   MAX_UPDATE [70000]   WARMUP_UPDATES [6% of MAX_UPDATE]
#   TOKENS_PER_SAMPLE [128]   MASK_PROB [0.3]   BATCH_SIZE [128 per GPU]   UPDATE_FREQ [32: 4096 sequences on 1 GPU]
#   LION_FORM [chunk]   PRECISION [fp16 on GPU, fp32 on CPU]   LOG_INTERVAL [100]   SEED [1]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 2 ] || die "usage: [ARCH=lion_s ...] bash $0 DATA_BIN SAVE_DIR [fairseq-train options]"
DATA=$1; SAVE=$2; shift 2
[ -f "$DATA/dict.txt" ] || die "DATA_BIN $DATA has no dict.txt: make it with python -m preprocess.text (see README.md)"
need fairseq-train

ARCH=${ARCH:-lion_s}
encoder_arch "$ARCH"
case "$ARCH" in *_large) DEFAULT_LR=2e-4 ;; *) DEFAULT_LR=8e-4 ;; esac
LR=${LR:-$DEFAULT_LR}
END_LR=${END_LR:-$(awk -v lr="$LR" 'BEGIN { printf "%g", lr * 0.02 }')}
MAX_UPDATE=${MAX_UPDATE:-70000}
whole MAX_UPDATE 0 "the linear decay ends there"
WARMUP_UPDATES=${WARMUP_UPDATES:-$(six_percent "$MAX_UPDATE")}
PFLAGS=$(precision_flags "$@") || exit 2

# polynomial_decay with power 1 = linear warm-up then linear decay to END_LR at MAX_UPDATE.
# --required-batch-size-multiple 1: fairseq's default (8) silently drops a last batch of another size,
# from the validation set too (fairseq issue #5036).
run fairseq-train "$DATA" --user-dir "$USER_DIR" \
  --task masked_lm --criterion masked_lm --arch "$ARCH" --lion-form "${LION_FORM:-chunk}" \
  --sample-break-mode complete --tokens-per-sample "${TOKENS_PER_SAMPLE:-128}" --mask-prob "${MASK_PROB:-0.3}" \
  --skip-invalid-size-inputs-valid-test \
  --optimizer adam --adam-betas "(0.9, 0.98)" --adam-eps 1e-6 --weight-decay 0.01 --clip-norm 0.0 \
  --lr-scheduler polynomial_decay --lr "$LR" --end-learning-rate "$END_LR" \
  --warmup-updates "$WARMUP_UPDATES" --total-num-update "$MAX_UPDATE" --max-update "$MAX_UPDATE" \
  --batch-size "${BATCH_SIZE:-128}" --update-freq "${UPDATE_FREQ:-32}" --required-batch-size-multiple 1 \
  --dropout 0.1 --attention-dropout 0.1 --seed "${SEED:-1}" \
  --save-dir "$SAVE" --no-epoch-checkpoints --tensorboard-logdir "$SAVE/tensorboard" \
  --log-format json --log-interval "${LOG_INTERVAL:-100}" $PFLAGS "$@"
