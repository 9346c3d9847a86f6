#!/usr/bin/env bash
# Creates (or reuses) .venv in the checkout with everything lion-fairseq needs, CPU-only.
# Sourced by run.sh; a second run reinstalls nothing unless the requirements changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
stamp_src() { cat "$ROOT/setup.py" "$ROOT/requirements.txt" "$ROOT/requirements-interpreter.txt" "$ROOT/scripts/env.sh"; }
want="$(stamp_src | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.lion-stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up $VENV (once)" >&2
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  # The CPU wheel that lies on disk here; an unpinned torch would pull several GB of CUDA wheels.
  "$VENV/bin/python" -c 'import torch' 2>/dev/null || pip install "torch==${LION_TORCH_VERSION:-2.13.0}"
  # fairseq 0.12.2 does not run on Python 3.11: ve-fairseq is its rebuild. --no-deps keeps torchaudio
  # (and with it a CUDA torch) out; its real run-time needs are in requirements.txt.
  pip install --no-deps "ve-fairseq==0.12.3"
  pip install -r "$ROOT/requirements.txt"
  # fla's kernels under Triton's CPU interpreter, for the tests (this venv is CPU-only; ~1 GB)
  pip install -r "$ROOT/requirements-interpreter.txt"
  pip install --no-deps -e "$ROOT"
  echo "$want" > "$VENV/.lion-stamp"
fi
export PATH="$VENV/bin:$PATH"
