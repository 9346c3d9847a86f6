#!/usr/bin/env bash
# The packages a lent GPU machine lacks (Python 3.12, torch and Triton there, no fairseq, hydra or fla),
# downloaded here into .whl/ (git-ignored), for `scripts/gpu_run.sh` to install there. Run it before the
# device call, and pass `.whl` in its carry list.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d .whl ve-fairseq==0.12.3 "hydra-core>=1.0.7,<1.4" "omegaconf<2.4" bitarray cffi \
  pycparser pyyaml packaging tqdm regex fla-core==0.6.0 einops
# hydra's parser runtime is published as source only: built here into a pure-Python wheel (the device
# has no network for a build environment)
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl
