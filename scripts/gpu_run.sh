#!/usr/bin/env bash
# On a lent GPU machine, from the checkout: install the packages `scripts/gpu_wheels.sh` carried in .whl/
# next to the machine's own torch and Triton (never replacing them), then run the GPU benchmark into
# $OUT (the folder the device tool brings back). Extra arguments go to the benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/lion-site
# a second call on the same (still warm) machine, such as `--tune`, finds them installed
[ -f "$SITE/.installed" ] || { python -m pip install -q --no-deps --target "$SITE" .whl/*.whl && touch "$SITE/.installed"; }
export PYTHONPATH="$SITE:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
exec python -m lion_fairseq.benchmark.gpu --out "${OUT:-/tmp/gpu}" "$@"
