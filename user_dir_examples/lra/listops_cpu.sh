#!/usr/bin/env bash
# ListOps end to end on a CPU, no download: generate -> binarise -> train LION-S -> test accuracy.
# The measurement in README.md was made with this script as is:
#   nice -n 10 bash user_dir_examples/lra/listops_cpu.sh
# Knobs (environment): WORK (output folder), NTRAIN/NVALID/NTEST (examples), ARCH, HOURS (training
# wall-clock budget), THREADS. Run from the repository root, in its virtual environment (or PYTHON=...).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
WORK=${WORK:-/tmp/lra_listops_cpu}
NTRAIN=${NTRAIN:-4000}; NVALID=${NVALID:-200}; NTEST=${NTEST:-500}
ARCH=${ARCH:-lion_s_lra_small}
HOURS=${HOURS:-0.5}
export OMP_NUM_THREADS=${THREADS:-2}
mkdir -p "$WORK"

# 1. LRA's ListOps distribution: 500 to 2000 tokens, depth <= 10, <= 10 arguments per operator
$PYTHON -m lion_fairseq.lra.listops --output-dir "$WORK/tsv" --num-train "$NTRAIN" --num-valid "$NVALID" \
    --num-test "$NTEST" --seed 1
# 2. the same converter as for the LRA release's listops-1000 folder
$PYTHON -m preprocess.lra listops --input-dir "$WORK/tsv" --destdir "$WORK/bin" --force
# 3. train for a fixed wall-clock budget, keep the checkpoint with the best valid accuracy
$PYTHON -m fairseq_cli.train "$WORK/bin" --user-dir lion_fairseq --cpu --num-workers 0 --seed 1 \
    --task lra_listops --arch "$ARCH" --criterion lion_classification \
    --lion-form chunk --lion-chunk-size 64 --dropout 0.1 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --weight-decay 0.01 --clip-norm 1.0 \
    --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 50 --warmup-init-lr 1e-7 \
    --batch-size 8 --max-epoch 100 --stop-time-hours "$HOURS" \
    --validate-interval-updates 100 --save-interval-updates 100 --keep-interval-updates 1 \
    --best-checkpoint-metric accuracy --maximize-best-checkpoint-metric --no-epoch-checkpoints \
    --save-dir "$WORK/checkpoints" --log-format json --log-interval 20 --no-progress-bar \
    2>&1 | tee "$WORK/train.log"
# 4. held-out test accuracy of the best checkpoint
$PYTHON -m fairseq_cli.validate "$WORK/bin" --user-dir lion_fairseq --cpu --num-workers 0 \
    --task lra_listops --criterion lion_classification --valid-subset test --batch-size 16 \
    --path "$WORK/checkpoints/checkpoint_best.pt" --log-format json --no-progress-bar \
    2>&1 | tee "$WORK/test.log"
grep -o '"test_accuracy": "[0-9.]*"\|"accuracy": "[0-9.]*"' "$WORK/test.log" | tail -1
