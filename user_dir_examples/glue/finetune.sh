#!/usr/bin/env bash
# Fine-tune a pretrained LION encoder on one GLUE task (RoBERTa's GLUE recipe, LION's settings).
#   bash user_dir_examples/glue/finetune.sh TASK_DATA_BIN PRETRAINED_CHECKPOINT SAVE_DIR [extra fairseq-train options]
# TASK_DATA_BIN is the output of prepare.sh; its preprocess.json gives the number of classes, whether
# the task is a regression and the training size. Environment (defaults in brackets):
#   ARCH [the pretrained checkpoint's, with its sizes; lion_s for another kind]
#   TASK [from TASK_DATA_BIN's folder name, for the metric]
#   LR [1e-5]   MAX_EPOCH [10]   BATCH_SIZE [32]   WEIGHT_DECAY [0.1]
#   MAX_POSITIONS [the length the checkpoint was pretrained at (roberta.base: 512), else 128]
#   MAX_UPDATE [MAX_EPOCH epochs]   WARMUP_UPDATES [6%]   NUM_CLASSES (only without preprocess.json)
#   LION_FORM [chunk]   PRECISION [fp16 on GPU, fp32 on CPU]   SEED [1]   LOG_INTERVAL [50]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
[ $# -ge 3 ] || die "usage: [ARCH=lion_s ...] bash $0 TASK_DATA_BIN PRETRAINED_CHECKPOINT SAVE_DIR [fairseq-train options]"
DATA=$1; CKPT=$2; SAVE=$3; shift 3
[ -d "$DATA/input0" ] && [ -d "$DATA/label" ] || die "TASK_DATA_BIN $DATA lacks input0/ and label/: make it with prepare.sh"
[ -f "$CKPT" ] || die "PRETRAINED_CHECKPOINT $CKPT not found"
need fairseq-train
# settings first: a wrong one is named before the checkpoint is read (seconds: it imports fairseq)
BATCH_SIZE=${BATCH_SIZE:-32}
MAX_EPOCH=${MAX_EPOCH:-10}
whole BATCH_SIZE 0
whole MAX_EPOCH
[ -z "${MAX_UPDATE:-}" ] || whole MAX_UPDATE 0 "the linear decay ends there"
# the arch, sizes and options the checkpoint was trained as (a softmax RoBERTa's as lion_s), and its length
TRAINED_AS=(); TRAINED_POSITIONS=""
TRAINED=$(python -m lion_fairseq.check_checkpoint --options --max-positions "$CKPT") \
  || die "PRETRAINED_CHECKPOINT $CKPT cannot be used (above)"
{ read -r -a TRAINED_AS; read -r TRAINED_POSITIONS; } <<< "$TRAINED" || true
if [ -n "${ARCH:-}" ]; then
  ARCH_OPTS=(--arch "$ARCH")
else  # lion_s for a checkpoint of another kind
  ARCH_OPTS=("${TRAINED_AS[@]}")
  [ ${#ARCH_OPTS[@]} -gt 0 ] || ARCH_OPTS=(--arch lion_s)
  ARCH=${ARCH_OPTS[1]}
fi
encoder_arch "$ARCH"
MAX_POSITIONS=${MAX_POSITIONS:-${TRAINED_POSITIONS:-128}}
whole MAX_POSITIONS

if [ -f "$DATA/preprocess.json" ]; then
  read -r JSON_CLASSES REGRESSION TRAIN_ROWS < <(python - "$DATA/preprocess.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print(m["num_classes"], int(m["regression"]), m["rows"]["train"])
PY
)
else
  JSON_CLASSES=""; REGRESSION=0; TRAIN_ROWS=""
fi
NUM_CLASSES=${NUM_CLASSES:-$JSON_CLASSES}
[ -n "$NUM_CLASSES" ] || die "set NUM_CLASSES (no $DATA/preprocess.json to read it from)"
if [ -z "${MAX_UPDATE:-}" ]; then
  [ -n "$TRAIN_ROWS" ] || die "set MAX_UPDATE (no $DATA/preprocess.json to count the training rows)"
  MAX_UPDATE=$(( (TRAIN_ROWS + BATCH_SIZE - 1) / BATCH_SIZE * MAX_EPOCH ))
  whole MAX_UPDATE 0 "the linear decay ends there"  # a given one was checked with the settings above
fi
WARMUP_UPDATES=${WARMUP_UPDATES:-$(six_percent "$MAX_UPDATE")}
PFLAGS=$(precision_flags "$@") || exit 2

TASK=${TASK:-$(basename "$DATA")}
TASK=${TASK%-bin}
METRIC=(--best-checkpoint-metric accuracy --maximize-best-checkpoint-metric)
case "${TASK,,}" in  # any case: a folder named cola-bin is CoLA's
  cola) METRIC=(--report-mcc --best-checkpoint-metric mcc --maximize-best-checkpoint-metric) ;;
  mrpc|qqp) METRIC=(--report-acc-and-f1 --best-checkpoint-metric acc_and_f1 --maximize-best-checkpoint-metric) ;;
  sst-2|sts-b|mnli|qnli|rte|wnli) ;;
  *) echo "warning: TASK '$TASK' is none of CoLA SST-2 MRPC QQP STS-B MNLI QNLI RTE WNLI: the metric is accuracy" \
       "(set TASK= for CoLA's Matthews correlation, MRPC's and QQP's F1)" >&2 ;;
esac
if [ "$REGRESSION" = 1 ]; then
  METRIC=(--regression-target --report-pearson-and-spearman
          --best-checkpoint-metric pearson_and_spearman --maximize-best-checkpoint-metric)
fi

# --max-positions: the length the encoder was pretrained at; --shorten-method truncate cuts longer
# pairs instead of dropping them. --finetune-from-model: a new run from the pretrained weights only, which
# a rerun resumes from SAVE_DIR/checkpoint_last.pt (--restore-file with --reset-* would start it over)
run fairseq-train "$DATA" --user-dir "$USER_DIR" --finetune-from-model "$CKPT" \
  --task sentence_prediction --criterion sentence_prediction "${ARCH_OPTS[@]}" --lion-form "${LION_FORM:-chunk}" \
  --num-classes "$NUM_CLASSES" --init-token 0 --separator-token 2 \
  --max-positions "$MAX_POSITIONS" --shorten-method truncate \
  --batch-size "$BATCH_SIZE" --required-batch-size-multiple 1 \
  --dropout 0.1 --attention-dropout 0.1 --weight-decay "${WEIGHT_DECAY:-0.1}" \
  --optimizer adam --adam-betas "(0.9, 0.98)" --adam-eps 1e-6 --clip-norm 0.0 \
  --lr-scheduler polynomial_decay --lr "${LR:-1e-5}" \
  --total-num-update "$MAX_UPDATE" --warmup-updates "$WARMUP_UPDATES" \
  --max-epoch "$MAX_EPOCH" --max-update "$MAX_UPDATE" --seed "${SEED:-1}" \
  --find-unused-parameters "${METRIC[@]}" \
  --save-dir "$SAVE" --no-epoch-checkpoints --log-format json --log-interval "${LOG_INTERVAL:-50}" $PFLAGS "$@"
