"""The GPU check and benchmark, for a lent CUDA machine, in one command:

    python -m lion_fairseq.benchmark.gpu --out DIR        # about 8 minutes on one H200 (an estimate; --budget-s)

1. Check: LION's Triton kernel (``backend="triton"``) against the PyTorch chunk form (``backend="torch"``)
   on the GPU: float32, and bf16 and fp16 (what ``fairseq-train --fp16`` and ``--amp`` feed it) each
   bidirectional and causal with no, per-head and per-token gates, at head size 64 (and 128 in 16 bits at
   the longest L): the normalised values and the gradients
   of q, k, v and both gates, as relative RMS errors (Triton has miscompiled kernels of this kind before:
   fla #640, so a new kernel is not taken on trust); and LION-D/S's feature map on its kernel against
   PyTorch's in float64, values and gradient, in each of the three dtypes.
2. Operator: forward (inference, no autograd) and forward+backward, bf16, H = 12, D = 64, the same tokens
   per batch at every L (``--tokens``), of LION-S (per-token gates), LION-D (per-head) and LION-LIT (none)
   on the kernel, LION-S and LION-LIT on fla, and ``scaled_dot_product_attention`` (FlashAttention);
   CUDA events after warm-up (which includes Triton's compiling), the median of ``--iters``; peak memory
   above the inputs; beside the kernel's times, its FLOPs and bytes per call as counted by ``kernel_cost``
   (an estimate) and the rates they imply; and LION-D/S's feature map, forward+backward, in PyTorch and on
   its kernel.
3. End to end: ``fairseq-train`` tokens per second (fairseq's ``wps``) in bf16 of ``lion_s_lm`` against
   ``transformer_lm`` and of ``lion_s`` against ``roberta_base`` (same width and depth) at each
   ``--train-lengths`` (``gpu_training.train_speed``), LION on the kernel; LION-S LM on fla too at one L.
4. Forms, as soon as the first ``lion_s_lm`` run of part 3 has saved its checkpoint (so that the budget
   never skips them): that checkpoint through ``fairseq-eval-lm`` in every form and backend, and recurrent
   decoding through the hub's generator on CUDA, checked token by token against the parallel form
   (``gpu_training.eval_lm_forms``, ``gpu_training.recurrent_decoding``).

``--precision-table`` and ``--mixed-precision-runs`` add the first GPU run's error-under-autocast table and
its fp16/amp/bf16 training of every variant. Writes ``gpu.md`` (tables) and ``gpu.json`` into ``--out``
after every measurement, so a run cut short keeps what it measured, and nothing else: the fairseq runs' files
go to ``--work``. Exits non-zero, with a message, when CUDA or Triton is missing."""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .gpu_training import (FORMS, PRECISIONS, eval_lm_forms, lion_backend, recurrent_decoding, train_and_evaluate,
                           train_speed)
from .options import out_folder

IMPLS = ("lion-s-triton", "lion-d-triton", "lion-lit-triton", "lion-s-fla", "lion-lit-fla", "sdpa")
GATES = ("none", "head", "token")
INPUT_NAMES = ("q", "k", "v", "log_a_fwd", "log_a_bwd")
FEATURE_MAP = "feature map"  # the check's rows of LION-D/S's feature map kernel, in its "gates" column
# relative RMS error allowed against the PyTorch chunk form (float32: products in float32 on both sides).
# At tests/test_gpu_benchmark.py's sizes under the interpreter (whose 16-bit products run in float32) the
# worst were 1.7e-3 (bf16) and 5.5e-4 (fp16): each 16-bit tolerance is a few roundings of its dtype, far
# below what a miscompiled kernel gives
TOLERANCE = {"float32": {"values": 1e-4, "grads": 1e-4}, "bfloat16": {"values": 1e-2, "grads": 3e-2},
             "float16": {"values": 3e-3, "grads": 1e-2}}
SIXTEEN_BITS = ("bfloat16", "float16")
# memory bandwidth (bytes/s) and dense bf16 tensor-core rate (FLOP/s) from NVIDIA's data sheets, by a word
# of torch.cuda.get_device_name(); the issue's targets are an H200's, while a loan may be an H100
PEAK_RATES = (("H200", 4.8e12, 989e12), ("H100 PCIe", 2.0e12, 756e12), ("H100", 3.35e12, 989e12))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.gpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # a str: the options are written into gpu.json and tune.json
    p.add_argument("--out", type=lambda text: str(out_folder(text)), required=True,
                   help="folder for gpu.md and gpu.json (tune.md and tune.json)")
    # the device tool brings back at most 8 files from its $OUT: the runs' corpus, binaries, checkpoints and
    # logs there could crowd out the report
    p.add_argument("--work", help="folder for the fairseq runs' data, checkpoints and logs (default: a new folder "
                                  "in the system's temporary folder, printed at the start)")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768", help="sequence lengths timed")
    p.add_argument("--check-lengths", default="1,1000,4096", help="sequence lengths of the kernel's check")
    p.add_argument("--tokens", type=int, default=32768, help="B = max(1, tokens // L) at each L")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--train-lengths", default="512,2048,8192", help="tokens per sample of the fairseq-train runs")
    p.add_argument("--train-tokens", type=int, default=16384, help="tokens per batch of the fairseq-train runs")
    p.add_argument("--train-updates", type=int, default=15)
    # what has started when the budget runs out goes on to its end: the one GPU run (an earlier version of
    # this benchmark, --budget-s 380) took 471 s in all, so 360 s should keep a run near 8 minutes
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="start no new timing, training or evaluation after this many seconds (the check always "
                        "runs)")
    p.add_argument("--tune", action="store_true",
                   help="instead of the parts above: LION-S timed at each candidate chunk, warps and programs per "
                        "SM of the kernel, each checked first (benchmark/gpu_tune.py); writes tune.md and tune.json")
    p.add_argument("--tune-lengths", default="1024,4096,32768", help="sequence lengths of --tune")
    p.add_argument("--precision-table", action="store_true", help="also the error under CUDA autocast")
    p.add_argument("--mixed-precision-runs", action="store_true",
                   help="also fairseq-train of lion_{lit,d,s}_lm with --fp16, --amp and bf16, each checkpoint in "
                        "every form")
    return p.parse_args(argv)


def refuse_reason() -> Optional[str]:
    """Why this machine cannot run the benchmark, or None."""
    import torch

    from lion_fairseq.ops.backend import triton_unavailable

    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False (torch " + torch.__version__ + ")"
    reason = triton_unavailable(torch.zeros(1, device="cuda"), (64, 64))
    return f"needs LION's Triton kernel, which cannot run: {reason}" if reason else None


def environment() -> Dict[str, str]:
    import importlib.metadata as md

    import torch

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for pkg in ("triton", "fla-core", "ve-fairseq"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = "-"
    return info


def make_inputs(B: int, H: int, L: int, D: int, dtype, gates: str = "token", seed: int = 0, grad: bool = False,
                device: str = "cuda"):
    """q, k as LION-D/S's feature map leaves them (positive, unit norm), v signed, log-gates in float32:
    ``(B, H, L)`` per token, ``(H, 1)`` per head, or None; ``"strong"``: per token near -3, so that each
    row is nearly its own diagonal term (the gradients of q and k are then small residues of cancelling
    terms, where 16-bit products show their rounding most)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.rand(B, H, L, D, device=device, generator=g) + 0.1, dim=-1).to(dtype)
    k = F.normalize(torch.rand(B, H, L, D, device=device, generator=g) + 0.1, dim=-1).to(dtype)
    v = torch.randn(B, H, L, D, device=device, generator=g).to(dtype)
    shape = {"none": None, "head": (H, 1), "token": (B, H, L), "strong": (B, H, L)}[gates]
    centre = -3.0 if gates == "strong" else 3.0
    f = F.logsigmoid(torch.randn(*shape, device=device, generator=g) + centre) if shape else None
    b = F.logsigmoid(torch.randn(*shape, device=device, generator=g) + centre) if shape else None
    return [x.requires_grad_(grad) if x is not None else None for x in (q, k, v, f, b)]


def rel_rms(x, ref) -> float:
    ref = ref.double()
    return ((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def outputs(inputs: list, weight, backend: str, causal: bool) -> tuple:
    """``(y, grads)`` of one chunk-form call on ``backend`` on fresh copies of ``inputs`` (q, k, v, log_a_fwd,
    log_a_bwd; None where absent), the loss ``sum(y * weight)``: y detached, the gradients as a dict by name."""
    from lion_fairseq.ops import lion_attention

    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    y = lion_attention(*leaves, form="chunk", causal=causal, backend=backend)
    (y.float() * weight).sum().backward()
    return y.detach(), {n: x.grad for n, x in zip(INPUT_NAMES, leaves) if x is not None}


def compare(got: tuple, ref: tuple, names: List[str], dtype_name: str) -> Dict:
    """``{"finite", "ok", "errors"}`` of ``outputs`` ``got`` against ``ref``: relative RMS errors of the values
    and of the gradients named (a gradient's error relative to the larger of its own size and a hundredth of
    the largest gradient's), within ``TOLERANCE``."""
    import torch

    size = lambda x: x.double().pow(2).mean().sqrt().item()  # noqa: E731
    floor = 1e-2 * max((size(ref[1][n]) for n in names), default=0.0)
    errors = {"values": rel_rms(got[0], ref[0])}
    for n in names:
        errors[f"d{n}"] = (got[1][n].double() - ref[1][n].double()).pow(2).mean().sqrt().item() / max(
            size(ref[1][n]), floor)
    finite = bool(torch.isfinite(got[0]).all()) and all(bool(torch.isfinite(got[1][n]).all()) for n in names)
    tol = TOLERANCE[dtype_name]
    ok = finite and errors["values"] < tol["values"] and all(errors[f"d{n}"] < tol["grads"] for n in names)
    return {"finite": finite, "ok": ok, "errors": errors}


def check(L: int, dtype_name: str, causal: bool, gates: str, device: str = "cuda", B: int = 2, H: int = 4,
          D: int = 64) -> Dict:
    """The kernel against the PyTorch chunk form (``compare``). At L = 1 the normalised output does not
    depend on q and k: their true gradients are eps-sized differences of terms near 1, rounding noise on
    both sides, and are left out."""
    import torch

    dtype = getattr(torch, dtype_name)
    inputs = make_inputs(B, H, L, D, dtype, gates, seed=L, device=device)
    weight = torch.randn(B, H, L, D, device=device, generator=torch.Generator(device=device).manual_seed(1))
    got, ref = (outputs(inputs, weight, backend, causal) for backend in ("triton", "torch"))
    names = [n for n, x in zip(INPUT_NAMES, inputs)
             if x is not None and not (causal and n == "log_a_bwd") and not (L == 1 and n in ("q", "k"))]
    return {"L": L, "dtype": dtype_name, "causal": causal, "gates": gates, "D": D,
            **compare(got, ref, names, dtype_name)}


def check_feature_map(L: int, dtype_name: str, device: str = "cuda", B: int = 2, H: int = 12, D: int = 64) -> Dict:
    """LION-D/S's feature map on its Triton kernel (``ops/feature_kernel.py``) against the PyTorch form in
    float64, on a ``(B, H, L, D)`` view of fairseq's ``(L, B, H*D)`` layout: relative RMS of the values and
    of x's gradient, within ``TOLERANCE``."""
    import torch

    from lion_fairseq.modules.feature_maps import silu_norm
    from lion_fairseq.ops.feature_kernel import silu_norm_kernel

    g = torch.Generator(device=device).manual_seed(L)
    x = (3 * torch.randn(L, B, H * D, device=device, generator=g)).to(getattr(torch, dtype_name))
    x = x.view(L, B, H, D).permute(1, 2, 0, 3)
    dy = torch.randn(x.shape, device=device, generator=g).to(x.dtype)
    got, ref = [], []
    for fn, inp, out in ((silu_norm_kernel, x, got), (silu_norm, x.double(), ref)):  # float64: the PyTorch form
        leaf = inp.detach().requires_grad_()
        y = fn(leaf)
        y.backward(dy.to(y.dtype))
        out += [y.detach(), {"x": leaf.grad}]
    return {"L": L, "dtype": dtype_name, "causal": False, "gates": FEATURE_MAP,
            **compare(tuple(got), tuple(ref), ["x"], dtype_name)}


def check_cases(lengths: List[int]) -> List[tuple]:
    """(L, dtype, causal, gates, head size): at head size 64 (every base and large arch's), per-token gates in
    float32, every gate kind in bf16 and fp16 (what training runs: fairseq-hydra-train's bf16,
    fairseq-train's ``--fp16`` and ``--amp``), and strong per-token gates in both past L = 1 (the same
    kernels as per-token gates: no compiling of their own); at head size 128 (the IWSLT archs', whose
    backward walks launch once per part and whose blocks are twice as wide), the longest L in 16 bits."""
    cases = []
    for L in lengths:
        for causal in (False, True):
            cases.append((L, "float32", causal, "token", 64))
            gates = GATES + (("strong",) if L > 1 else ())
            cases += [(L, dtype_name, causal, g, 64) for dtype_name in SIXTEEN_BITS for g in gates]
    L = max(lengths)
    cases += [(L, "bfloat16", False, g, 128) for g in GATES]
    cases += [(L, "bfloat16", True, "token", 128), (L, "float16", False, "token", 128)]
    return cases


def runner(impl: str) -> Callable:
    import torch.nn.functional as F

    from lion_fairseq.ops import lion_attention

    if impl == "sdpa":
        return lambda q, k, v, f, b: F.scaled_dot_product_attention(q, k, v)
    backend = impl.split("-")[-1]
    return lambda q, k, v, f, b: lion_attention(q, k, v, f, b, form="chunk", backend=backend)


def gates_of(impl: str) -> str:
    return {"s": "token", "d": "head", "lit": "none"}.get(impl.split("-")[1], "none") if impl != "sdpa" else "none"


def time_ms(fn: Callable, warmup: int, iters: int, device: str = "cuda") -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, the wall clock elsewhere), after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def peak_mib(fn: Callable, device: str = "cuda") -> Optional[float]:
    """Peak memory that one call of ``fn`` allocates above what is allocated before it (CUDA only)."""
    import torch

    if device != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def kernel_cost(B: int, H: int, L: int, D: int, gates: str, mode: str, chunks: Tuple[int, int] = (32, 16),
                segments: bool = True, in_bytes: int = 2, fused: bool = True) -> Dict[str, float]:
    """An estimate, counted from ``ops/kernel.py``, of one bidirectional normalised call: FLOPs (2 per
    multiply-add, matmuls only) and bytes moved (each launch reads its chunk's rows once; no cache reuse
    across launches is assumed). Per token and head, with Dk = Dv = D and chunks of ``chunks`` = (C forward,
    C backward), the kernel's at D = 64 (``BLOCKS``). A "row" is D values of ``in_bytes``; with 16-bit
    inputs a sum that another launch reads is stored as a pair of rows (``_store_sum``).

    - forward, gated: two walks of ``q k^T``, ``A v`` (2 C D each), ``q S``, ``k^T v`` (2 D^2 each), plus
      one more ``k^T v`` per walk for the segments' sums; reads q, k, v per walk (and k, v for the sums);
      y is written by the first walk, read and written by the second (pairs, the second's only where a
      backward follows), and the float32 row sums written twice, read once;
    - forward, no gates: the sums ``k^T v`` and one ``q S``; reads k, v, q once, writes y once;
    - backward, gated: ``dden`` from dy and y; per walk, its part along (``q k^T``, ``do v^T``, ``dA k``:
      three C x C products; two state products) and its part against (four C x C products, three state
      products), one launch (``fused``, the kernel's ``FUSED``) or one launch each, plus the segments' sums
      of the queries' states, and of the keys' where the gates are one per head (their gradient wants
      distance-weighted sums beside them; per-token gates take them from the forward's walks); each launch
      reads q, k, v, dy and two float32 row values; dq, dk, dv are each written by two launches, the second
      adding to the first's pair;
    - backward, no gates: ``dden``, the queries' sums and three state products; reads q, k, v, dy once, and
      writes dq, dk, dv once."""
    tokens = B * H * L
    row = D * in_bytes
    pair = 1 + (in_bytes < 4)  # rows per stored sum that is read again
    c_fwd, c_bwd = chunks
    launches = 2 if fused else 4  # of the gated backward's walks
    if gates == "none":
        flops = {"fwd": 4 * D * D, "bwd": 10 * D * D}
        io = {"fwd": 4 * row + 4, "bwd": (9 + pair) * row + 24}
    else:
        sums = 2 * 2 * D * D if segments else 0  # both directions' segment sums
        keys_again = gates == "head"  # the backward's own sums of the keys' states
        flops = {"fwd": 2 * (4 * c_fwd * D + 4 * D * D) + sums,
                 "bwd": 2 * (14 * c_bwd * D + 10 * D * D) + (1 + keys_again) * sums}
        io = {"fwd": (6 + (4 if segments else 0) + 2 * pair + 1) * row + 12,
              "bwd": ((1 + pair) + launches * 4 + 3 * (1 + 2 * pair) + ((4 + 4 * keys_again) if segments else 0)) *
                     row + 8 + launches * 8 + (16 if segments else 0) + 8}
    y_kept = (pair - 1) * row  # the second half of y's pair, written where a backward will read it
    if mode == "fwdbwd":
        return {"flops": tokens * (flops["fwd"] + flops["bwd"]),
                "bytes": tokens * (io["fwd"] + y_kept + io["bwd"])}
    return {"flops": tokens * flops["fwd"], "bytes": tokens * io["fwd"]}


def fla_missing(device: str = "cuda") -> Optional[str]:
    """Why fla cannot run here, or None (its columns and runs are then skipped, not run on a fallback)."""
    import torch

    from lion_fairseq.ops.fla import fla_unavailable

    return fla_unavailable(torch.zeros(1, device=device))


def timed_calls(run: Callable, inputs: list, grad_out) -> Dict[str, Callable[[], None]]:
    """What is timed of ``run`` on ``inputs``: "fwd", one call without autograd (inference), and "fwdbwd",
    one call and its backward from ``grad_out``."""
    import torch

    def fwd():
        with torch.no_grad():
            run(*inputs)

    def fwdbwd():
        for x in inputs:
            if x is not None:
                x.grad = None
        run(*inputs).backward(grad_out)

    return {"fwd": fwd, "fwdbwd": fwdbwd}


def measure(impl: str, B: int, H: int, L: int, D: int, warmup: int, iters: int, device: str = "cuda") -> Dict:
    import torch

    missing = fla_missing(device) if impl.endswith("fla") else None
    if missing:
        return {"fwd_ms": "not run: " + missing}
    inputs = make_inputs(B, H, L, D, torch.bfloat16, gates_of(impl), grad=True, device=device)
    grad_out = torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16)
    result = {}
    for mode, fn in timed_calls(runner(impl), inputs, grad_out).items():
        try:
            result[f"{mode}_ms"] = time_ms(fn, warmup, iters, device)
            result[f"{mode}_mib"] = peak_mib(fn, device)
        except torch.cuda.OutOfMemoryError:
            result[f"{mode}_ms"] = result[f"{mode}_mib"] = "OOM"
        if impl.endswith("triton") and isinstance(result[f"{mode}_ms"], float):
            from lion_fairseq.ops.kernel import _Config, cuts_into_segments

            cost = kernel_cost(B, H, L, D, gates_of(impl), mode, segments=cuts_into_segments(inputs[0], inputs[2]),
                               fused=_Config(inputs[0], inputs[2], 64, None, backward=True).fused)
            result[f"{mode}_tflops"] = cost["flops"] / result[f"{mode}_ms"] / 1e9
            result[f"{mode}_gbps"] = cost["bytes"] / result[f"{mode}_ms"] / 1e6
        if device == "cuda":
            torch.cuda.empty_cache()
    return result


def measure_feature_map(tokens: int, H: int, D: int, warmup: int, iters: int, device: str = "cuda") -> Dict:
    """Forward+backward ms of LION-D/S's feature map on ``tokens`` tokens, bf16, in fairseq's layout: PyTorch's
    form (``LION_BACKEND=torch``) against its kernel (``LION_BACKEND=triton``)."""
    import torch

    from lion_fairseq.modules.feature_maps import silu_norm

    x = torch.randn(tokens, H * D, device=device, dtype=torch.bfloat16).view(tokens, 1, H, D).permute(1, 2, 0, 3)
    x.requires_grad_()
    dy = torch.randn(x.shape, device=device, dtype=torch.bfloat16)
    out = {}
    for backend in ("torch", "triton"):
        with lion_backend(backend):
            out[f"{backend}_ms"] = time_ms(lambda: silu_norm(x).backward(dy), warmup, iters, device)
    return out


def rates_line(gpu_name: str) -> str:
    """The data-sheet peaks the rates table is read against: this GPU's where known, else an H200's."""
    peak = next((r for r in PEAK_RATES if r[0] in gpu_name), None)  # the first model the name holds
    known = f"{peak[0]}'s data sheet" if peak else f"no data sheet known for {gpu_name!r}; an H200's"
    _, bytes_per_s, flops = peak or PEAK_RATES[0]
    return f"Peaks ({known}): {bytes_per_s / 1e12:.2f} TB/s, {flops / 1e12:.0f} dense bf16 TFLOP/s."


def fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else ("-" if x is None else str(x))


def markdown(report: Dict) -> str:
    env, a = report["environment"], report["args"]
    lines = ["# LION's Triton kernel, fla and softmax attention (SDPA) on a GPU", "",
             ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "`python -m lion_fairseq.benchmark.gpu`", "",
             *([f"**The GPU became unusable in the benchmark's process** ({report['cuda_lost']}). The parts run "
                "in that process stopped there; fairseq-train and fairseq-eval-lm run in processes of their own "
                "and went on.", ""] if report.get("cuda_lost") else []),
             "## The kernel against the PyTorch chunk form (relative RMS)", "",
             "| L | dtype | causal | gates | D | values | worst gradient | ok |", "|---|---|---|---|---|---|---|---|"]
    for c in report["check"]:
        if "error" in c:
            lines.append(f"| {c['L']} | {c['dtype']} | {c['causal']} | {c.get('gates', '-')} | {c.get('D', 64)} | "
                         f"error: {c['error']} | | NO |")
            continue
        grads = {k: v for k, v in c["errors"].items() if k != "values"}
        worst = max(grads, key=grads.get)
        lines.append(f"| {c['L']} | {c['dtype']} | {c['causal']} | {c['gates']} | {c.get('D', 64)} | {c['errors']['values']:.2e} | "
                     f"{worst} {grads[worst]:.2e} | {'yes' if c['ok'] else 'NO'} |")
    impls = list(IMPLS)
    lines += ["", f"## Operator: H={a['heads']}, D={a['dim']}, bf16, bidirectional, normalised, {a['tokens']} "
              f"tokens per batch; median of {a['iters']} after {a['warmup']} warm-up calls; memory is the peak "
              "above the inputs. lion-s: per-token gates, lion-d: per head, lion-lit: none."]
    for title, key in (("forward, ms", "fwd_ms"), ("forward+backward, ms", "fwdbwd_ms"),
                       ("forward peak, MiB", "fwd_mib"), ("forward+backward peak, MiB", "fwdbwd_mib")):
        lines += ["", f"### {title}", "", "| L | B | " + " | ".join(impls) + " |", "|---|---|" + "---|" * len(impls)]
        for row in report["timing"]:
            cells = [fmt(row["results"].get(i, {}).get(key, "-")) for i in impls]
            lines.append(f"| {row['L']} | {row['B']} | " + " | ".join(cells) + " |")
    lines += ["", "### The kernel's rates, from the FLOPs and bytes that `kernel_cost` estimates per call", "",
              rates_line(env.get("gpu", "")), "",
              "| L | impl | fwd TFLOP/s | fwd GB/s | fwd+bwd TFLOP/s | fwd+bwd GB/s |", "|---|---|---|---|---|---|"]
    for row in report["timing"]:
        for impl in (i for i in impls if i.endswith("triton")):
            r = row["results"].get(impl, {})
            if "fwd_tflops" in r:
                lines.append(f"| {row['L']} | {impl} | {fmt(r['fwd_tflops'])} | {fmt(r['fwd_gbps'])} | "
                             f"{fmt(r.get('fwdbwd_tflops'))} | {fmt(r.get('fwdbwd_gbps'))} |")
    if report.get("feature_map"):
        f = report["feature_map"]
        lines += ["", f"### LION-D/S's feature map, forward+backward, {a['tokens']} tokens, bf16", "",
                  f"error: {f['error']}" if "error" in f else
                  f"PyTorch: {fmt(f['torch_ms'])} ms; its Triton kernel: {fmt(f['triton_ms'])} ms."]
    if report.get("speed"):
        lines += ["", f"## fairseq-train in bf16, tokens per second (fairseq's wps, median after 3 updates), "
                  f"{a['train_tokens']} tokens per batch", "",
                  "| task | model | backend | L | B | wps | vs softmax | s |", "|---|---|---|---|---|---|---|---|"]
        for r in report["speed"]:
            if r.get("error"):
                lines.append(f"| {r['task']} | {r['arch']} | {r['backend'] or '-'} | {r['L']} | | "
                             f"error: {r['error'][-200:]!r} | | |")
                continue
            lines.append(f"| {r['task']} | {r['arch']} | {r['backend'] or '-'} | {r['L']} | {r['B']} | "
                         f"{fmt(r['wps'])} | {fmt(r.get('vs_softmax'))} | {r['seconds']} |")
    if report.get("eval_lm"):
        e = report["eval_lm"]
        lines += ["", f"## fairseq-eval-lm of {e.get('checkpoint', '-')} in every form (loss, base 2)", "",
                  "| form | loss | perplexity |", "|---|---|---|"]
        for form, r in e.get("forms", {}).items():
            lines.append(f"| {form} | {fmt(r.get('loss'))} | {fmt(r.get('ppl'))} |" if "error" not in r
                         else f"| {form} | error: {r['error'][-200:]!r} | |")
    if report.get("decoding"):
        d = report["decoding"]
        lines += ["", "## Recurrent decoding through the hub's generator", ""]
        lines.append(f"error: {d['error']}" if "error" in d else
                     f"{d['new_tokens']} greedy tokens after a {d['prompt_tokens']}-token prompt, "
                     f"{fmt(d['ms_per_token'])} ms per token; the parallel form's argmax agrees at "
                     f"{d['agree']} of {d['new_tokens']} positions.")
    if report.get("precision"):
        from .precision import table

        lines += ["", "## Error under CUDA autocast against float64 (width 256, 4 heads)", "",
                  table(report["precision"])]
    if report.get("train"):
        lines += ["", "## fairseq-train, L = 4096, 20 updates, then the loss of the checkpoint in each form", "",
                  "| model | precision | first / last loss | finite | " + " | ".join(FORMS) + " | forms agree | s |",
                  "|---|---|---|---|" + "---|" * len(FORMS) + "---|---|"]
        for r in report["train"]:
            if "error" in r:
                lines.append(f"| lion_{r['variant']}_lm | {r['precision']} | error: {r['error'][-200:]!r} |")
                continue
            ends = f"{r['losses'][0]:.3f} / {r['losses'][-1]:.3f}" if r["losses"] else "-"
            forms = " | ".join(f"{r['forms'][f]:.4f}" for f in FORMS)
            lines.append(f"| lion_{r['variant']}_lm | {r['precision']} | {ends} | {'yes' if r['finite'] else 'NO'} | "
                         f"{forms} | {'yes' if r['forms_agree'] else 'NO'} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def save(out: Path, report: Dict) -> None:
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    (out / "gpu.md").write_text(markdown(report))


def speed_runs(args: argparse.Namespace, fla: bool = True) -> List[tuple]:
    """(task, arch, backend, L): each softmax model beside its LION counterpart on the kernel, per L, and
    LION-S LM on fla at the middle L (where fla is installed)."""
    lengths = [int(x) for x in args.train_lengths.split(",")]
    runs = []
    for L in lengths:
        runs += [("lm", "transformer_lm", None, L), ("lm", "lion_s_lm", "triton", L),
                 ("mlm", "roberta_base", None, L), ("mlm", "lion_s", "triton", L)]
    if fla:
        runs.append(("lm", "lion_s_lm", "fla", lengths[len(lengths) // 2]))
    return runs


def cuda_lost() -> Optional[str]:
    """Why this process can no longer use the GPU, or None: a kernel's fault (an illegal address, say)
    leaves the CUDA context unusable for the rest of the process, while new processes start afresh."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return None
    except Exception as e:
        return repr(e)[:300]


def lost_after(report: Dict, where: str) -> Optional[str]:
    """After a failure at ``where``: why this process can no longer use the GPU (``cuda_lost``), or None;
    the first such reason is kept in ``report["cuda_lost"]``."""
    lost = cuda_lost()
    if lost:
        report.setdefault("cuda_lost", f"after {where}: {lost}")
    return lost


def evaluate_forms(report: Dict, checkpoint: Path, L: int, fla: bool, lost: Optional[str]) -> None:
    """Into ``report``: ``fairseq-eval-lm`` of the LION LM checkpoint in every form and backend ("eval_lm";
    the chunk form on fla where ``fla``), and greedy recurrent decoding through the hub's generator
    ("decoding"), which runs in this process: not where its CUDA context is ``lost``."""
    forms = tuple(f for f in FORMS if fla or f != "chunk-fla")
    report["eval_lm"] = {"checkpoint": f"lion_s_lm, L = {L}", "forms": eval_lm_forms(checkpoint, L, forms=forms)}
    print(f"eval-lm: {report['eval_lm']}", flush=True)
    try:
        report["decoding"] = recurrent_decoding(checkpoint) if not lost else {"error": "not run: " + lost}
    except Exception as e:
        report["decoding"] = {"error": repr(e)[:300]}
    print(f"decoding: {report['decoding']}", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    reason = refuse_reason()
    if reason:
        print(f"lion_fairseq.benchmark.gpu: {reason}", file=sys.stderr)
        return 2
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tune:
        from . import gpu_tune

        return gpu_tune.run(args, out, environment())
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="lion-gpu-"))
    report = {"environment": environment(), "args": vars(args), "check": [], "timing": [], "speed": []}
    print(report["environment"], f"fairseq runs in {root}", flush=True)
    started = time.time()
    over = lambda: time.time() - started > args.budget_s  # noqa: E731
    fla = not fla_missing()
    # where a fault has made this process's GPU unusable, its own parts stop; those in subprocesses go on
    lost: Optional[str] = None
    cases = check_cases([int(x) for x in args.check_lengths.split(",")])
    cases += [(4096, dtype_name, False, FEATURE_MAP, 64) for dtype_name in ("float32",) + SIXTEEN_BITS]
    for L, dtype_name, causal, gates, D in cases:
        c = {"L": L, "dtype": dtype_name, "causal": causal, "gates": gates, "D": D, "ok": False}
        if lost:
            c["error"] = "not run: CUDA context lost"
        else:
            try:
                c = check(L, dtype_name, causal, gates, D=D) if gates != FEATURE_MAP else check_feature_map(L, dtype_name)
            except Exception as e:
                c["error"] = repr(e)[:300]
                lost = lost_after(report, f"the check at L = {L}, {dtype_name}, causal={causal}, {gates}")
        report["check"].append(c)
        print(f"check L={L} {dtype_name} causal={causal} {gates} D={D}: {c.get('errors', c.get('error'))}", flush=True)
        save(out, report)
    for L in (int(x) for x in args.lengths.split(",")):
        B = max(1, args.tokens // L)
        row = {"L": L, "B": B, "results": {}}
        report["timing"].append(row)
        for impl in IMPLS:
            if over() or lost:
                row["results"][impl] = {"fwd_ms": "skipped (budget)" if not lost else "not run: CUDA context lost"}
                continue
            try:
                row["results"][impl] = measure(impl, B, args.heads, L, args.dim, args.warmup, args.iters)
            except Exception as e:  # fla missing or refusing: recorded, the rest goes on
                row["results"][impl] = {"fwd_ms": f"error: {e!r}"[:200]}
                lost = lost_after(report, f"{impl} at L = {L}")
            if not lost:
                torch.cuda.empty_cache()
            print(f"L={L} B={B} {impl}: {row['results'][impl]}", flush=True)
            save(out, report)
    if not over() and not lost:
        try:
            report["feature_map"] = measure_feature_map(args.tokens, args.heads, args.dim, args.warmup, args.iters)
        except Exception as e:
            report["feature_map"] = {"error": repr(e)[:300]}
            lost = lost_after(report, "the feature map's timing")
        print(f"feature map: {report['feature_map']}", flush=True)
        save(out, report)
    softmax_wps = {}
    for task, arch, backend, L in speed_runs(args, fla=fla):
        if over():
            report["speed"].append({"task": task, "arch": arch, "backend": backend, "L": L, "error": "skipped (budget)"})
            continue
        keep = task == "lm" and backend == "triton" and L == int(args.train_lengths.split(",")[0])
        try:
            r = train_speed(root, task, arch, L, backend, tokens=args.train_tokens, updates=args.train_updates,
                            keep_checkpoint=keep)
        except Exception as e:
            r = {"task": task, "arch": arch, "backend": backend, "L": L, "error": repr(e)[:300]}
        if backend is None and r.get("wps"):
            softmax_wps[(task, L)] = r["wps"]
        if backend is not None and r.get("wps") and (task, L) in softmax_wps:
            r["vs_softmax"] = r["wps"] / softmax_wps[(task, L)]
        report["speed"].append(r)
        print(f"train {task} {arch} {backend} L={L}: {r}", flush=True)
        save(out, report)
        if r.get("checkpoint"):  # at once, not after the other runs: the budget must not skip what never ran on a GPU
            evaluate_forms(report, Path(r["checkpoint"]), L, fla, lost)
            save(out, report)
    if args.precision_table and not over() and not lost:
        from . import precision

        try:
            report["precision"] = precision.measure([4096], torch.get_num_threads(), device="cuda")
        except Exception as e:
            report["precision_error"] = repr(e)[:300]
        save(out, report)
    if args.mixed_precision_runs:
        report["train"] = []
        variants = ("lit", "d", "s")
        runs = sorted(((v, p) for v in variants for p in PRECISIONS),
                      key=lambda vp: (variants.index(vp[0]) - PRECISIONS.index(vp[1])) % len(PRECISIONS))
        for variant, prec in runs:
            if over():
                report["train"].append({"variant": variant, "precision": prec, "error": "skipped (budget)"})
                continue
            try:
                r = train_and_evaluate(root, variant, prec)
            except Exception as e:
                r = {"variant": variant, "precision": prec, "ok": False, "error": repr(e)[:300]}
            report["train"].append(r)
            save(out, report)
    save(out, report)  # with what the budget skipped, which no measurement's save has written
    print(markdown(report))
    failed = [c for c in report["check"] if not c.get("ok")]
    failed += [r for r in report["speed"] + report.get("train", []) if r.get("error") and "budget" not in r["error"]]
    if report.get("decoding", {}).get("error") or any("error" in r for r in report.get("eval_lm", {}).get("forms", {}).values()):
        failed.append("forms")
    if failed:
        print(f"{len(failed)} checks or runs failed; see {out / 'gpu.md'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
