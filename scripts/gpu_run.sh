#!/usr/bin/env bash
# On a lent GPU machine, from the checkout: install the packages `scripts/gpu_wheels.sh` carried in .whl/
# next to the machine's own torch and Triton (never replacing them), then run the GPU benchmark into
# $OUT (the folder the device tool brings back): gpu.md, gpu.json and gpu.log (tune.* with --tune).
# Extra arguments go to the benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/lion-site
# a second call on the same (still warm) machine, such as `--tune`, finds them installed
[ -f "$SITE/.installed" ] || { python3 -m pip install -q --no-deps --target "$SITE" .whl/*.whl && touch "$SITE/.installed"; }
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
DIR="${OUT:-/tmp/gpu}"
mkdir -p "$DIR"
case " $* " in *" --tune "*) LOG=tune.log ;; *) LOG=gpu.log ;; esac
# the whole output in a log beside the report (the device tool's reply holds only its last 12,000
# characters); the fairseq runs' files stay out of $DIR (--work), whose files come back 8 at most
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m lion_fairseq.benchmark.gpu --out "$DIR" "$@"
} 2>&1 | tee "$DIR/$LOG"
