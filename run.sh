#!/usr/bin/env bash
# The two commands of the README: `bash run.sh demo` (the main job) and `bash run.sh test`.
set -euo pipefail
here=$PWD
cd "$(dirname "$0")"
source scripts/env.sh
case "${1:-}" in
  # from the caller's folder: a relative --corpus or --workdir means what it says there
  demo) shift; cd "$here"; exec python -m lion_fairseq.demo "$@" ;;
  # two workers, a test file each (files share expensive module fixtures), the longest files first
  # (tests/conftest.py): half the wall time on 2 cores
  test) shift; exec python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests "$@" ;;
  *) echo "usage: bash run.sh {demo|test} [args...]" >&2; exit 2 ;;
esac
