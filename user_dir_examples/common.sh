# Sourced by the recipes. Sets USER_DIR (the folder to pass as --user-dir) and defines helpers.
# USER_DIR: this checkout's lion_fairseq/, else the pip-installed package's folder, else set it yourself.
RECIPES_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${USER_DIR:-}" ]; then
  if [ -f "$RECIPES_ROOT/lion_fairseq/__init__.py" ]; then
    USER_DIR="$RECIPES_ROOT/lion_fairseq"
  elif command -v lion-fairseq-user-dir >/dev/null 2>&1; then
    USER_DIR="$(lion-fairseq-user-dir)"
  else
    echo "error: lion_fairseq not found: set USER_DIR=/path/to/lion_fairseq or pip install lion-fairseq" >&2
    exit 1
  fi
fi

die() { echo "error: $*" >&2; exit 2; }

# Print a command (shell-quoted, so it can be pasted) and run it.
run() { printf '+' >&2; printf ' %q' "$@" >&2; printf '\n' >&2; "$@"; }

need() { command -v "$1" >/dev/null 2>&1 || die "$1 not found: activate the environment (source .venv/bin/activate)"; }

# PRECISION=fp16|amp|fp32 (default: fp16 when nvidia-smi sees a GPU and the arguments, the script's own,
# hold no --cpu; else fp32) -> fairseq-train flags.
precision_flags() {
  local p="${PRECISION:-}" a
  if [ -z "$p" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then p=fp16; else p=fp32; fi
    for a in "$@"; do [ "$a" != --cpu ] || p=fp32; done  # fairseq's --fp16 optimizer needs CUDA
  fi
  case "$p" in
    fp16) echo "--fp16" ;;
    amp) echo "--amp" ;;
    fp32) echo "" ;;
    bf16) die "PRECISION=bf16: fairseq-train --bf16 takes a TPU code path and crashes in fairseq 0.12; use the hydra recipe (common.fp16=false common.bf16=true) or PRECISION=fp16" ;;
    *) die "PRECISION must be fp16, amp, fp32 (or bf16 through the hydra recipe), got '$p'" ;;
  esac
}

# 6% of $1, at least 1 when $1 > 0 (the paper's linear warm-up share).
six_percent() { local w=$(( $1 * 6 / 100 )); if [ "$w" -lt 1 ] && [ "$1" -gt 0 ]; then w=1; fi; echo "$w"; }

# warm-up of MAX_UPDATE ($1) updates for a recipe whose full run warms up $2 of $3: the same share, at most $2
# (a short run would otherwise end inside the warm-up, at a tiny learning rate); 0 (fairseq: no limit) gets $2
warmup_share() {
  local m=$1 w=$2
  if [ "$m" -gt 0 ] && [ "$m" -lt "$3" ]; then w=$(( m * $2 / $3 )); fi
  if [ "$w" -lt 1 ]; then w=1; fi
  echo "$w"
}

# an ARCH of another kind fails in fairseq-train on an option it does not take: name it first
encoder_arch() {
  case "$1" in
    *_lm|*_lm_*|*_transformer|*_transformer_*|*_lra_*)
      die "ARCH must be a masked-LM encoder (lion_{lit,d,s}[_large|_tiny], the pretrained checkpoint's), got '$1'" ;;
  esac
}

# the same for the causal LM and translation recipes (fairseq-train fails on an option the arch's model lacks)
lm_arch() {
  case "$1" in
    lion_lm|*_lm|*_lm_*) ;;
    *) die "ARCH must be a causal LM (lion_{lit,d,s}_lm[_tiny], lion_retnet_lm, lion_s_lm_plus[_tiny]), got '$1'" ;;
  esac
}
translation_arch() {
  case "$1" in
    lion_transformer|*_transformer|*_transformer_*) ;;
    *) die "ARCH must be a translation model (lion_{lit,d,s}_transformer{,_iwslt_de_en,_tiny}), got '$1'" ;;
  esac
}

# a setting ($1 names it) that picks the form a trained checkpoint runs in, through --model-overrides (fairseq's
# evaluation tools take no --lion-form): a bad one failed there with a traceback, after loading the model
lion_form_setting() {
  case "${!1}" in
    parallel|chunk|recurrent) ;;
    *) die "$1 must be parallel, chunk or recurrent (the --lion-form to run the checkpoint in), got '${!1}'" ;;
  esac
}

is_int() { case "$1" in ''|*[!0-9]*) return 1 ;; *) return 0 ;; esac; }

# the setting named $1 must hold a whole number (above $2 where given; $3 says why); it is rewritten in
# decimal, which the arithmetic after it then reads as typed (bash reads a leading zero as octal)
whole() {
  local v="${!1}"
  is_int "$v" && [ "$(( 10#$v ))" -gt "${2:--1}" ] || die "$1 must be a whole number${2:+ above $2}${3:+ ($3)}, got '$v'"
  printf -v "$1" '%d' "$(( 10#$v ))"
}
