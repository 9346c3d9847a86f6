#!/usr/bin/env bash
# Train a LION classifier on one Long Range Arena task with the LRA paper's budget, then report the test
# accuracy of the best-valid checkpoint (see README.md beside this file).
#   bash user_dir_examples/lra/train.sh TASK DATA_BIN SAVE_DIR [extra fairseq-train options]
# TASK: listops | text | retrieval | image | pathfinder | pathx; DATA_BIN: from python -m preprocess.lra.
# Settings come from the environment (defaults in brackets):
#   VARIANT [s]  lit | d | s      ARCH [lion_${VARIANT}_lra_${TASK}]  (lion_*_lra_small fits a CPU)
#   ORDER [two_snake; row_major for LION-LIT, which has no decay] for image, pathfinder, pathx:
#         row_major | row_snake | col_snake | two_snake
#   BATCH_SIZE, LR, MAX_UPDATE [the task's LRA budget, below]   LION_FORM [chunk]
#   WARMUP_UPDATES [the budget's, or the same share of a shorter MAX_UPDATE]
#   PRECISION [fp16 on GPU, fp32 on CPU; amp]   VALIDATE_INTERVAL [500]   LOG_INTERVAL [50]   SEED [1]
#
# Budgets (Tay et al. 2021, the LRA release's configs). LRA's "0.05 * linear warmup * rsqrt decay" is
# fairseq's inverse_sqrt with --lr 0.05/sqrt(warmup) and the same warmup; Adam betas (0.9, 0.98). The
# LRA paper's Transformer reached, with these budgets: ListOps 36.37, Text 64.27, Retrieval 57.46,
# Image 42.44, Pathfinder 71.40, Path-X failed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
PFLAGS=$(precision_flags "$@") || exit 2
[ $# -ge 3 ] || die "usage: [VARIANT=s ...] bash $0 TASK DATA_BIN SAVE_DIR [fairseq-train options]"
TASK=$1; DATA=$2; SAVE=$3; shift 3
[ -f "$DATA/lra.json" ] || die "DATA_BIN $DATA has no lra.json: make it with python -m preprocess.lra (see README.md)"
need fairseq-train

case "$TASK" in
  #            batch lr       scheduler     warmup updates  weight decay
  listops)    set -- 32  1.58e-3 inverse_sqrt 1000 5000   0.1 "$@" ;;
  text)       set -- 32  5.59e-4 inverse_sqrt 8000 20000  0.1 "$@" ;;
  retrieval)  set -- 32  5.59e-4 inverse_sqrt 8000 5000   0.1 "$@" ;;
  # one epoch of warmup, then cosine decay over 200 epochs (45000 / 256, 160000 / 512, 160000 / 64 per epoch)
  image)      set -- 256 5e-4    cosine       175  35000  0.0 "$@" ;;
  pathfinder) set -- 512 1e-3    cosine       312  62400  0.0 "$@" ;;
  pathx)      set -- 64  1e-3    cosine       2500 500000 0.0 "$@" ;;
  *) die "TASK must be listops, text, retrieval, image, pathfinder or pathx; got '$TASK'" ;;
esac
BATCH_SIZE=${BATCH_SIZE:-$1}; LR=${LR:-$2}; SCHEDULER=$3
MAX_UPDATE=${MAX_UPDATE:-$5}; WEIGHT_DECAY=$6
whole MAX_UPDATE
# a shorter run warms up for the same share of it (a short run otherwise ended inside the warm-up)
WARMUP_UPDATES=${WARMUP_UPDATES:-$(warmup_share "$MAX_UPDATE" "$4" "$5")}; shift 6
whole WARMUP_UPDATES
SCHEDULE_OPTS=()
if [ "$SCHEDULER" = cosine ]; then
  # fairseq's cosine decays over max-update minus the warm-up: none left divides by zero; the period is
  # fixed here, so that --max-update passed on stops partway through this schedule instead of rescaling it
  [ "$MAX_UPDATE" -gt "$WARMUP_UPDATES" ] || die "$TASK decays its learning rate over \
MAX_UPDATE minus WARMUP_UPDATES updates: MAX_UPDATE ($MAX_UPDATE) must exceed WARMUP_UPDATES ($WARMUP_UPDATES)"
  SCHEDULE_OPTS=(--lr-period-updates "$(( MAX_UPDATE - WARMUP_UPDATES ))")
fi
VARIANT=${VARIANT:-s}
case "$VARIANT" in lit|d|s) ;; *) die "VARIANT must be lit, d or s; got '$VARIANT'" ;; esac
ARCH=${ARCH:-lion_${VARIANT}_lra_${TASK}}
case "$ARCH" in
  lion_*lra*) ;;
  *) die "ARCH must be an LRA classifier (lion_{lit,d,s}_lra_{$TASK,small,tiny}), got '$ARCH'" ;;
esac
ORDER_OPTS=()
case "$TASK" in
  image|pathfinder|pathx)
    # two_snake averages two scans' decay masks: LION-LIT has none, so both would be all ones
    case "$ARCH" in lion_lit_*) TWO_D_ORDER=row_major ;; *) TWO_D_ORDER=two_snake ;; esac
    ORDER_OPTS=(--lion-order "${ORDER:-$TWO_D_ORDER}") ;;
  *) [ -z "${ORDER:-}" ] || die "ORDER orders the pixels of image, pathfinder and pathx; $TASK is a sequence already" ;;
esac

run fairseq-train "$DATA" --user-dir "$USER_DIR" \
  --task "lra_$TASK" --arch "$ARCH" --criterion lion_classification --lion-form "${LION_FORM:-chunk}" ${ORDER_OPTS[@]+"${ORDER_OPTS[@]}"} \
  --optimizer adam --adam-betas "(0.9, 0.98)" --adam-eps 1e-9 --weight-decay "$WEIGHT_DECAY" --clip-norm 1.0 \
  --lr-scheduler "$SCHEDULER" ${SCHEDULE_OPTS[@]+"${SCHEDULE_OPTS[@]}"} --lr "$LR" --warmup-updates "$WARMUP_UPDATES" \
  --max-update "$MAX_UPDATE" \
  --batch-size "$BATCH_SIZE" --seed "${SEED:-1}" \
  --best-checkpoint-metric accuracy --maximize-best-checkpoint-metric --no-epoch-checkpoints \
  --validate-interval-updates "${VALIDATE_INTERVAL:-500}" --save-interval-updates "${VALIDATE_INTERVAL:-500}" \
  --keep-interval-updates 1 --save-dir "$SAVE" --log-format json --log-interval "${LOG_INTERVAL:-50}" $PFLAGS "$@"
need fairseq-validate
run fairseq-validate "$DATA" --user-dir "$USER_DIR" --task "lra_$TASK" --criterion lion_classification \
  --valid-subset test --batch-size "$BATCH_SIZE" --path "$SAVE/checkpoint_best.pt" --log-format json $PFLAGS
