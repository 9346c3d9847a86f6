#!/usr/bin/env bash
# The two commands of the README: `bash run.sh demo` (the main job) and `bash run.sh test`.
set -euo pipefail
source "$(dirname "$0")/scripts/env.sh"
case "${1:-}" in
  # from the caller's folder: a relative --corpus or --workdir means what it says there
  demo) shift; exec python -m lion_fairseq.demo "$@" ;;
  # two workers, a test file each (files share expensive module fixtures), the longest files first
  # (tests/conftest.py): half the wall time on 2 cores
  test) shift; cd "$(dirname "$0")"; exec python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests "$@" ;;
  *) echo "usage: bash run.sh {demo|test} [args...]" >&2; exit 2 ;;
esac
