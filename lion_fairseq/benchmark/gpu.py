"""One-off GPU check and benchmark of LION on flash-linear-attention (fla), for a lent CUDA machine:

    python -m lion_fairseq.benchmark.gpu --out DIR        # about 5-10 minutes on one H100/H200

1. Agreement: ``lion_attention(form="chunk")`` on fla's kernels against the PyTorch chunk form
   (``LION_FLA=0``), float32 and bf16, bidirectional and causal, per-token gates: the values, and the
   gradients of q, k, v and both gates of the unnormalised product (``check``), as relative RMS errors.
2. Speed: forward (inference, no autograd) and forward+backward of bidirectional LION with per-token gates
   in bf16 (fla; fla without the normaliser column; the PyTorch chunk form), and without gates on fla
   (LION-LIT, whose backward is fla's own on every GPU), against
   ``torch.nn.functional.scaled_dot_product_attention`` in bf16, H=12, D=64, L = 1K ... 32K, with the
   same number of tokens per batch at every L (``--tokens``), CUDA events after warm-up (which includes
   Triton's autotuning), the median of ``--iters``; peak memory above the inputs
   (``torch.cuda.max_memory_allocated``).
3. Mixed precision: the error of one attention module under CUDA autocast (fp16, bf16) against float64,
   LION-LIT/D/S in each form against fairseq's softmax ``MultiheadAttention`` (``benchmark/precision.py``).
4. Training: a short real ``fairseq-train`` of ``lion_{lit,d,s}_lm`` at L = 4096 with ``--fp16``, ``--amp``
   and bf16 (``benchmark/gpu_training.py``): finite losses, and the checkpoint's loss the same in every form.
   The first three runs cover every variant and every precision, in case ``--budget-s`` ends the phase early.

Writes ``gpu.md`` (tables) and ``gpu.json`` into ``--out``; the JSON after every measurement, so a run cut
short keeps what it measured. Exits with a message, and non-zero, when CUDA or fla is missing."""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .gpu_training import FORMS, PRECISIONS, train_and_evaluate

# lion-lit-fla: no gates (LION-LIT), whose backward is fla's own on every GPU
IMPLS = ("lion-fla", "lion-fla-nonorm", "lion-lit-fla", "lion-torch-chunk", "sdpa")
# relative RMS error allowed against the PyTorch chunk form: fla's fp32 matmuls run in TF32
TOLERANCE = {"float32": {"values": 3e-3, "grads": 3e-3}, "bfloat16": {"values": 1e-2, "grads": 2e-2}}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.gpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu.md and gpu.json")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768", help="sequence lengths timed")
    p.add_argument("--check-lengths", default="1,65,1000,4096", help="sequence lengths of the agreement check")
    p.add_argument("--tokens", type=int, default=32768, help="B = max(1, tokens // L) at each L")
    p.add_argument("--batch", type=int, default=None, help="a fixed batch size instead of --tokens")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--train-length", type=int, default=4096, help="tokens per sample of the training runs")
    p.add_argument("--train-updates", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="stop starting new training runs and timings after this many seconds (the check "
                        "always runs)")
    return p.parse_args(argv)


def refuse_reason() -> Optional[str]:
    """Why this machine cannot run the benchmark, or None."""
    import torch

    from lion_fairseq.ops import fla as fla_mod

    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False (torch " + torch.__version__ + ")"
    if os.environ.get("LION_FLA", "1") == "0":
        return "LION_FLA=0 turns fla off; unset it to benchmark fla"
    if fla_mod._load() is None:
        return "needs flash-linear-attention's kernels: pip install fla-core (the lion-fairseq[fla] extra)"
    return None


def environment() -> Dict[str, str]:
    import importlib.metadata as md

    import torch

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for pkg in ("triton", "fla-core", "flash-linear-attention", "tilelang"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = "-"
    return info


def make_inputs(B: int, H: int, L: int, D: int, dtype, seed: int = 0, grad: bool = False):
    """q, k as LION-D's feature map leaves them (positive, unit norm), v signed, per-token log-gates in float32."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.rand(B, H, L, D, device="cuda", generator=g) + 0.1, dim=-1).to(dtype)
    k = F.normalize(torch.rand(B, H, L, D, device="cuda", generator=g) + 0.1, dim=-1).to(dtype)
    v = torch.randn(B, H, L, D, device="cuda", generator=g).to(dtype)
    f = F.logsigmoid(torch.randn(B, H, L, device="cuda", generator=g) + 3)
    b = F.logsigmoid(torch.randn(B, H, L, device="cuda", generator=g) + 3)
    return [x.requires_grad_(grad) for x in (q, k, v, f, b)]


def with_fla(on: bool) -> None:
    os.environ["LION_FLA"] = "1" if on else "0"


def rel_rms(x, ref) -> float:
    ref = ref.double()
    return ((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def forward_kernel_backward(x) -> Optional[str]:
    """How LION-D/S get their gradients on fla here when it is not fla's own backward (``fla_backward_refused``
    on x's device), else None."""
    from lion_fairseq.ops.fla import fla_backward_refused

    refusal = fla_backward_refused(x)
    return "fla's forward kernel: " + refusal if refusal else None


def check(L: int, dtype_name: str, causal: bool) -> Dict:
    """fla against the PyTorch chunk form, as relative RMS errors: the normalised values of a gated call (what
    the layers use), and the gradients of q, k, v and both gates of the unnormalised product (what fla
    computes). The division by the row sum is the same PyTorch code on both sides, and its gradients in q
    and k are differences of nearly equal terms: at L = 1 the output does not depend on q and k at all, its
    gradients there are about eps, and TF32's rounding of the two terms swamps them (measured: 200x).
    ``backward`` says which backward ran: fla's own, or its forward kernel where fla refuses its gated
    backward (``fla_backward_refused``)."""
    import torch

    from lion_fairseq.ops import lion_attention

    dtype = getattr(torch, dtype_name)
    inputs = make_inputs(2, 4, L, 64, dtype, seed=L)
    weight = torch.randn(2, 4, L, 64, device="cuda", dtype=torch.float64,
                         generator=torch.Generator(device="cuda").manual_seed(1))
    outs = {}
    for on in (True, False):
        with_fla(on)
        with torch.no_grad():
            y = lion_attention(*inputs, form="chunk", causal=causal)
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        (lion_attention(*leaves, form="chunk", causal=causal, normalize=False).double() * weight).sum().backward()
        outs[on] = (y, [x.grad for x in leaves])
    with_fla(True)
    names = ["q", "k", "v", "log_a_fwd"] + ([] if causal else ["log_a_bwd"])
    errors = {"values": rel_rms(outs[True][0], outs[False][0])}
    errors.update({f"d{n}": rel_rms(a, r) for n, a, r in zip(names, outs[True][1], outs[False][1])})
    finite = all(bool(torch.isfinite(x).all()) for x in [outs[True][0]] + outs[True][1][:len(names)])
    tol = TOLERANCE[dtype_name]
    ok = finite and errors["values"] < tol["values"] and all(errors[f"d{n}"] < tol["grads"] for n in names)
    return {"L": L, "dtype": dtype_name, "causal": causal, "finite": finite, "ok": ok, "errors": errors,
            "backward": forward_kernel_backward(inputs[0]) or "fla's"}


def runner(impl: str) -> Callable:
    import torch.nn.functional as F

    from lion_fairseq.ops import lion_attention

    if impl == "sdpa":
        return lambda q, k, v, f, b: F.scaled_dot_product_attention(q, k, v)
    if impl == "lion-lit-fla":
        return lambda q, k, v, f, b: lion_attention(q, k, v, None, None, form="chunk")
    normalize = impl != "lion-fla-nonorm"
    return lambda q, k, v, f, b: lion_attention(q, k, v, f, b, form="chunk", normalize=normalize)


def cuda_time_ms(fn: Callable, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn: Callable) -> float:
    """Peak memory that one call of ``fn`` allocates above what is allocated before it."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def measure(impl: str, B: int, H: int, L: int, D: int, warmup: int, iters: int) -> Dict:
    import torch

    with_fla(impl != "lion-torch-chunk")
    run = runner(impl)
    inputs = make_inputs(B, H, L, D, torch.bfloat16, grad=True)
    grad_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            run(*inputs)

    def fwdbwd():
        for x in inputs:
            x.grad = None
        run(*inputs).backward(grad_out)

    how = forward_kernel_backward(inputs[0]) if impl in ("lion-fla", "lion-fla-nonorm") else None
    result = {"backward": how} if how else {}
    for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        try:
            result[f"{mode}_ms"] = cuda_time_ms(fn, warmup, iters)
            result[f"{mode}_mib"] = peak_mib(fn)
        except torch.cuda.OutOfMemoryError:
            result[f"{mode}_ms"] = result[f"{mode}_mib"] = "OOM"
        torch.cuda.empty_cache()
    with_fla(True)
    return result


def fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def markdown(report: Dict) -> str:
    env, a = report["environment"], report["args"]
    lines = ["# LION on fla vs softmax attention (SDPA)", "",
             ", ".join(f"{k} {v}" for k, v in env.items()), "",
             f"`python -m lion_fairseq.benchmark.gpu` H={a['heads']}, D={a['dim']}, bf16, bidirectional, "
             f"per-token gates; median of {a['iters']} after {a['warmup']} warm-up calls; memory is the peak "
             "above the inputs.", "", "## Agreement with the PyTorch chunk form (relative RMS)", "",
             "| L | dtype | causal | values | worst gradient | ok |", "|---|---|---|---|---|---|"]
    for c in report["check"]:
        if "error" in c:
            lines.append(f"| {c['L']} | {c['dtype']} | {c['causal']} | error: {c['error']} | | no |")
            continue
        grads = {k: v for k, v in c["errors"].items() if k != "values"}
        worst = max(grads, key=grads.get)
        lines.append(f"| {c['L']} | {c['dtype']} | {c['causal']} | {c['errors']['values']:.2e} | "
                     f"{worst} {grads[worst]:.2e} | {'yes' if c['ok'] else 'NO'} |")
    for how in sorted({c["backward"] for c in report["check"] if "backward" in c}):
        lines += ["", "Gated gradients by " + how]
    if report.get("precision"):
        from .precision import table

        lines += ["", "## Error under CUDA autocast against float64 (width 256, 4 heads)", "",
                  table(report["precision"])]
    if report.get("train"):
        lines += ["", f"## fairseq-train, L = {a['train_length']}, {a['train_updates']} updates, then the loss of "
                  "the checkpoint in each form", "",
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
    impls = list(IMPLS)
    for title, key in (("forward, ms", "fwd_ms"), ("forward+backward, ms", "fwdbwd_ms"),
                       ("forward peak, MiB", "fwd_mib"), ("forward+backward peak, MiB", "fwdbwd_mib")):
        lines += ["", f"## {title}", "", "| L | B | " + " | ".join(impls) + " |",
                  "|---|---|" + "---|" * len(impls)]
        for row in report["timing"]:
            cells = [fmt(row["results"].get(i, {}).get(key, "-")) for i in impls]
            lines.append(f"| {row['L']} | {row['B']} | " + " | ".join(cells) + " |")
        own = {r["backward"] for row in report["timing"] for r in row["results"].values() if r.get("backward")}
        if key.startswith("fwdbwd") and own:
            lines += ["", "lion-fla and lion-fla-nonorm: gradients by " + "; ".join(sorted(own))]
    return "\n".join(lines) + "\n"


def save(out: Path, report: Dict) -> None:
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    (out / "gpu.md").write_text(markdown(report))


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    reason = refuse_reason()
    if reason:
        print(f"lion_fairseq.benchmark.gpu: {reason}", file=sys.stderr)
        return 2
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(), "args": vars(args), "check": [], "timing": []}
    print(report["environment"], flush=True)
    started = time.time()
    for L in (int(x) for x in args.check_lengths.split(",")):
        for dtype_name in ("float32", "bfloat16"):
            for causal in (False, True):
                try:
                    c = check(L, dtype_name, causal)
                except Exception as e:  # e.g. fla refusing this GPU/Triton pair: record it, go on
                    c = {"L": L, "dtype": dtype_name, "causal": causal, "ok": False, "error": repr(e)[:300]}
                report["check"].append(c)
                print(f"check L={L} {dtype_name} causal={causal}: {c.get('errors', c.get('error'))}", flush=True)
                save(out, report)
    for L in (int(x) for x in args.lengths.split(",")):
        B = args.batch or max(1, args.tokens // L)
        row = {"L": L, "B": B, "results": {}}
        report["timing"].append(row)
        for impl in IMPLS:
            if time.time() - started > args.budget_s:
                row["results"][impl] = {"fwd_ms": "skipped (budget)"}
                continue
            try:
                row["results"][impl] = measure(impl, B, args.heads, L, args.dim, args.warmup, args.iters)
            except Exception as e:
                row["results"][impl] = {"fwd_ms": f"error: {e!r}"[:200]}
            torch.cuda.empty_cache()
            print(f"L={L} B={B} {impl}: {row['results'][impl]}", flush=True)
            save(out, report)
    from . import precision

    try:
        report["precision"] = precision.measure([4096], torch.get_num_threads(), device="cuda")
    except Exception as e:
        report["precision_error"] = repr(e)[:300]
        print(f"precision: {e!r}", flush=True)
    save(out, report)
    report["train"] = []
    # the first three runs already cover every variant and every precision, in case the budget ends early
    variants = ("lit", "d", "s")
    runs = sorted(((v, p) for v in variants for p in PRECISIONS),
                  key=lambda vp: (variants.index(vp[0]) - PRECISIONS.index(vp[1])) % len(PRECISIONS))
    for variant, prec in runs:
        if time.time() - started > args.budget_s:
            report["train"].append({"variant": variant, "precision": prec, "error": "skipped (budget)"})
            continue
        try:
            row = train_and_evaluate(out / "train", variant, prec, length=args.train_length,
                                     updates=args.train_updates)
        except Exception as e:
            row = {"variant": variant, "precision": prec, "ok": False, "error": repr(e)[:300]}
        report["train"].append(row)
        print(f"train lion_{variant}_lm {prec}: {row}", flush=True)
        save(out, report)
    print(markdown(report))
    failed = [c for c in report["check"] + report["train"] if not c.get("ok", c.get("error") == "skipped (budget)")]
    if failed:
        print(f"{len(failed)} checks or training runs failed; see {out / 'gpu.md'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
