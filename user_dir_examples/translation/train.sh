#!/usr/bin/env bash
# LION translation model, fairseq's IWSLT'14 de-en transformer recipe with a LION arch.
#   bash user_dir_examples/translation/train.sh DATA_BIN SAVE_DIR [extra fairseq-train options]
# Environment (defaults in brackets):
#   ARCH [lion_s_transformer_iwslt_de_en]  lion_{lit,d,s}_transformer{,_iwslt_de_en,_tiny}
#   CROSS_ATTENTION [softmax]  softmax | linear (O(1) per decoding step whatever the source length)
#   LR [5e-4]   DROPOUT [0.3]   MAX_UPDATE [60000]   MAX_TOKENS [4096 per GPU]
#   WARMUP_UPDATES [4000, or the same share of a shorter MAX_UPDATE]
#   LION_FORM [chunk]   LION_CHUNK_SIZE [64]   PRECISION [fp16 on GPU, fp32 on CPU; amp]   SEED [1]
#   LOG_INTERVAL [100]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 2 ] || die "usage: [ARCH=lion_s_transformer_iwslt_de_en ...] bash $0 DATA_BIN SAVE_DIR [fairseq-train options]"
DATA=$1; SAVE=$2; shift 2
ls "$DATA"/dict.*.txt >/dev/null 2>&1 || die "DATA_BIN $DATA has no dict.<lang>.txt: make it with prepare.sh"
need fairseq-train
ARCH=${ARCH:-lion_s_transformer_iwslt_de_en}
translation_arch "$ARCH"
MAX_UPDATE=${MAX_UPDATE:-60000}
whole MAX_UPDATE
WARMUP_UPDATES=${WARMUP_UPDATES:-$(warmup_share "$MAX_UPDATE" 4000 60000)}
PFLAGS=$(precision_flags "$@") || exit 2

run fairseq-train "$DATA" --user-dir "$USER_DIR" \
  --task translation --arch "$ARCH" --share-decoder-input-output-embed \
  --lion-cross-attention "${CROSS_ATTENTION:-softmax}" \
  --lion-form "${LION_FORM:-chunk}" --lion-chunk-size "${LION_CHUNK_SIZE:-64}" \
  --dropout "${DROPOUT:-0.3}" --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0 --weight-decay 0.0001 \
  --lr "${LR:-5e-4}" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP_UPDATES" \
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --max-tokens "${MAX_TOKENS:-4096}" --required-batch-size-multiple 1 --max-update "$MAX_UPDATE" \
  --seed "${SEED:-1}" --save-dir "$SAVE" --no-epoch-checkpoints --tensorboard-logdir "$SAVE/tensorboard" \
  --log-format json --log-interval "${LOG_INTERVAL:-100}" $PFLAGS "$@"
