"""Benchmark of the LION operator's forms against softmax attention (``scaled_dot_product_attention``,
what fairseq's layers compute) at the same shape: time of forward and of forward+backward, and the peak
memory of inference, against sequence length.

    python -m lion_fairseq.benchmark.operator                 # B=1, H=12, D=64, L=256..16384, 2 threads and 1
    python -m lion_fairseq.benchmark.operator --small         # a one-minute run

Each (implementation, L) runs in a fresh process, so that the peak resident memory it reports (the
rise of the process's peak resident set over the inputs) is its own. Writes a Markdown table, a JSON file and a log-log
plot into ``--out``.

For the chunk form it also measures its ceiling: the batched matmuls it runs (recorded from one
forward+backward, every shape and stride as the op used them), replayed alone on random operands. The
share ``matmuls alone / whole op`` is how close the form is to what the machine's GEMMs allow; the
rest of its time is elementwise work, the scan's per-chunk steps and memory traffic."""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .options import default_text, fill_unset, out_folder, positive_int
from .plotting import against_length, pyplot
from .rss import maxrss_mib, reset_peak

# ``*_bf16``: inference (forward only) with bfloat16 inputs, the chunk form with matmul_dtype=bfloat16
IMPLS = ("sdpa", "parallel", "chunk", "recurrent", "sdpa_bf16", "chunk_bf16")
# what the scaling runs time at their thread counts: every speed-up the tables quote
SCALING_IMPLS = ("sdpa", "chunk", "sdpa_bf16", "chunk_bf16")
# the options that --small shortens unless given: (full run, --small)
DEFAULTS = {"lengths": ([256, 1024, 2048, 4096, 16384], [256, 512, 1024, 2048]), "repeats": (3, 1),
            "scaling_threads": ([1], [])}
# beyond these lengths a run would not fit this machine's memory (the L x L forms) or take minutes
# (autograd through the recurrent form's token loop stores a D x D state per token)
LIMITS = {("parallel", "fwd"): 8192, ("parallel", "fwdbwd"): 4096, ("recurrent", "fwdbwd"): 2048,
          ("sdpa_bf16", "fwdbwd"): 0, ("chunk_bf16", "fwdbwd"): 0}


def chunk_flops(batch: int, heads: int, L: int, dk: int, dv: int, C: int) -> Dict[str, float]:
    """Multiply-adds x 2 of the bidirectional, normalised chunk form's matmuls, per head: forward
    ``2LC(Dk+Dv)`` inside chunks, ``8L Dk Dv`` for both directions' states (made and read) and ``4L Dk``
    for the normaliser's; backward ``4LC(Dk+Dv) + 16L Dk Dv + 4L Dk``."""
    fwd = 2 * L * C * (dk + dv) + 8 * L * dk * dv + 4 * L * dk
    bwd = 4 * L * C * (dk + dv) + 16 * L * dk * dv + 4 * L * dk
    return {"fwd": batch * heads * fwd, "fwdbwd": batch * heads * (fwd + bwd)}


def matmul_gflops(threads: int, n: int = 2048, repeats: int = 3, dtype: Optional[Any] = None) -> float:
    """This machine's matmul rate with ``threads`` threads, float32 unless ``dtype`` (a torch dtype)
    says otherwise: the ceiling for the chunk form."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def cpu_name() -> str:
    """The CPU's model name (timings differ by 2x between the machines one kind of runner gets)."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


GEMMS = ("bmm.default", "bmm.out", "baddbmm.default", "baddbmm_.default", "baddbmm.out")


def record_gemms(run) -> List[Dict]:
    """The batched matmuls ``run()`` makes: each one's operands' shapes and strides."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: List[Dict] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func).split(".", 1)[-1]  # "aten.baddbmm_.default" -> "baddbmm_.default"
            if name in GEMMS:
                a, b = (args[0], args[1]) if "baddbmm" not in name else (args[1], args[2])
                calls.append({"a": (tuple(a.shape), tuple(a.stride())), "b": (tuple(b.shape), tuple(b.stride())),
                              "add": "baddbmm" in name})
            return func(*args, **(kwargs or {}))

    with Record():
        run()
    return calls


def _strided(shape, stride):
    import torch

    return torch.empty_strided(shape, stride).normal_()


def replay_gemms(calls: List[Dict], repeats: int) -> Dict[str, float]:
    """Best and worst of ``repeats`` timings of the recorded matmuls alone, and their multiply-adds x 2."""
    import torch

    ops = [(_strided(*c["a"]), _strided(*c["b"]), c["add"]) for c in calls]
    outs = [torch.empty(a.shape[0], a.shape[1], b.shape[2]) if add else None for a, b, add in ops]
    times = []
    for _ in range(repeats + 1):  # the first run pages in the operands
        t = time.perf_counter()
        for (a, b, add), o in zip(ops, outs):
            o.baddbmm_(a, b) if add else torch.bmm(a, b)
        times.append(time.perf_counter() - t)
    flops = sum(2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2] for a, b, _ in ops)
    return {"best": min(times[1:]), "worst": max(times[1:]), "flops": float(flops)}


def measure(impl: str, L: int, batch: int, heads: int, dim: int, threads: int, chunk_size: int,
            repeats: int, modes: List[str]) -> Dict[str, Optional[float]]:
    """Run in the child process: returns seconds per mode (best of ``repeats``) and inference peak MiB."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    q = torch.rand(batch, heads, L, dim) / dim ** 0.5
    k = torch.rand(batch, heads, L, dim) / dim ** 0.5
    v = torch.randn(batch, heads, L, dim)
    log_f = F.logsigmoid(torch.randn(batch, heads, L) + 3)
    log_b = F.logsigmoid(torch.randn(batch, heads, L) + 3)
    low = impl.endswith("_bf16")
    if low:
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    inputs = [q, k, v, log_f, log_b]

    if impl.startswith("sdpa"):
        def run(x):
            return F.scaled_dot_product_attention(x[0], x[1], x[2])
    else:
        from lion_fairseq.ops import lion_attention

        form = impl.replace("_bf16", "")
        mm = torch.bfloat16 if low else None

        def run(x):
            return lion_attention(*x, form=form, chunk_size=chunk_size, matmul_dtype=mm)

    out: Dict[str, Optional[float]] = {}
    with torch.no_grad():  # one-time set-up of the libraries (thread pools, kernels) is not the form's memory
        run([x[..., :16, :] if x.dim() == 4 else x[..., :16] for x in inputs])
    reset_peak()  # the bfloat16 inputs' float32 originals were freed: their pages are not the form's
    base = maxrss_mib()
    with torch.no_grad():
        run(inputs)
    out["peak_mib"] = maxrss_mib() - base
    for mode in modes:
        if L > LIMITS.get((impl, mode), 1 << 30):
            out[mode] = None
            continue
        times = []
        for _ in range(repeats):
            if mode == "fwd":
                t = time.perf_counter()
                with torch.no_grad():
                    run(inputs)
                times.append(time.perf_counter() - t)
            else:
                leaves = [x.clone().requires_grad_() for x in inputs]
                t = time.perf_counter()
                run(leaves).sum().backward()
                times.append(time.perf_counter() - t)
        out[mode], out[f"{mode}_worst"] = min(times), max(times)
    if impl.startswith("chunk"):
        flops = chunk_flops(batch, heads, L, dim, dim, min(chunk_size, L))
        for mode in modes:
            if out[mode]:
                out[f"gflops_{mode}"] = flops[mode] / out[mode] / 1e9
        if "fwdbwd" in modes and not low:
            leaves = [x.clone().requires_grad_() for x in inputs]
            gemm = replay_gemms(record_gemms(lambda: run(leaves).sum().backward()), repeats)
            out["gemm_fwdbwd"] = gemm["best"]
            out["gemm_gflops"] = gemm["flops"] / gemm["best"] / 1e9
            out["gemm_share"] = gemm["best"] / out["fwdbwd"]
    return out


def run_child(args: argparse.Namespace, impl: str, L: int) -> Dict[str, Optional[float]]:
    if L > LIMITS.get((impl, "fwd"), 1 << 30):  # not even inference fits: nothing to run
        return {"fwd": None, "fwdbwd": None, "peak_mib": None}
    cmd = [sys.executable, "-m", "lion_fairseq.benchmark.operator", "--child", impl, str(L),
           "--batch", str(args.batch), "--heads", str(args.heads), "--dim", str(args.dim),
           "--threads", str(args.threads), "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def speedup(num: Optional[float], den: Optional[float]) -> str:
    """``num / den`` as a table's speed-up (``2.50x``), ``-`` where either was not measured."""
    return f"{num / den:.2f}x" if num and den else "-"


def threads_name(n: int) -> str:
    return f"{n} thread" + ("s" if n > 1 else "")


def fmt(x: Optional[float], digits: int = 3) -> str:
    """A measurement for a table: ``digits`` decimals below 10, one above, ``-`` when not measured."""
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if x < 10 else f"{x:.1f}"


def table(results: Dict[str, Dict[int, Dict]], lengths: List[int]) -> str:
    lines = ["| L | impl | fwd s | fwd+bwd s | inference peak MiB | fwd+bwd speed-up vs softmax |",
             "|---:|---|---:|---:|---:|---:|"]
    for L in lengths:
        ref = results.get("sdpa", {}).get(L, {}).get("fwdbwd")
        for impl, per_len in results.items():
            r = per_len.get(L, {})
            if "error" in r:
                lines.append(f"| {L} | {impl} | error: {r['error']} | | | |")
                continue
            speed = f"{ref / r['fwdbwd']:.1f}x" if ref and r.get("fwdbwd") else "-"
            lines.append(f"| {L} | {impl} | {fmt(r.get('fwd'))} | {fmt(r.get('fwdbwd'))} | "
                         f"{fmt(r.get('peak_mib'))} | {speed} |")
    return "\n".join(lines)


def plot(results: Dict[str, Dict[int, Dict]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(axes, ("fwd", "fwdbwd", "peak_mib"),
                              ("forward (s)", "forward + backward (s)", "inference peak memory (MiB)")):
        against_length(ax, results, key, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def ceiling_table(scaling: Dict[int, Dict[str, Dict[int, Dict]]], lengths: List[int]) -> str:
    """The chunk form against softmax and against its own matmuls, at each thread count."""
    lines = ["| L | threads | chunk fwd+bwd s (best-worst) | softmax fwd+bwd s | speed-up | chunk GFLOP/s | "
             "its matmuls alone s | share of its matmuls' rate |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for L in lengths:
        for threads, res in scaling.items():
            c, ref = res["chunk"].get(L, {}), res["sdpa"].get(L, {}).get("fwdbwd")
            if not c.get("fwdbwd"):
                continue
            speed = f"{ref / c['fwdbwd']:.1f}x" if ref else "-"
            lines.append(f"| {L} | {threads} | {fmt(c['fwdbwd'])}-{fmt(c['fwdbwd_worst'])} | {fmt(ref)} | {speed} | "
                         f"{c['gflops_fwdbwd']:.1f} | {fmt(c.get('gemm_fwdbwd'))} | {100 * c.get('gemm_share', 0):.0f}% |")
    return "\n".join(lines)


def bf16_table(scaling: Dict[int, Dict[str, Dict[int, Dict]]], lengths: List[int]) -> str:
    """Inference (forward) in bfloat16 against float32, the chunk form against softmax, at each thread count."""
    lines = ["| L | threads | chunk fp32 s | chunk bf16 s (best-worst) | bf16 speed-up | softmax fp32 s | "
             "softmax bf16 s | chunk bf16 vs softmax bf16 |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for L in lengths:
        for threads, res in scaling.items():
            get = lambda impl: res.get(impl, {}).get(L, {})  # noqa: E731
            c32, c16 = get("chunk").get("fwd"), get("chunk_bf16")
            s32, s16 = get("sdpa").get("fwd"), get("sdpa_bf16").get("fwd")
            if not c16.get("fwd"):
                continue
            up = f"{c32 / c16['fwd']:.2f}x" if c32 else "-"
            vs = f"{s16 / c16['fwd']:.1f}x" if s16 else "-"
            lines.append(f"| {L} | {threads} | {fmt(c32)} | {fmt(c16['fwd'])}-{fmt(c16['fwd_worst'])} | {up} | "
                         f"{fmt(s32)} | {fmt(s16)} | {vs} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.operator", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                   help=default_text(DEFAULTS["lengths"]))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=12)
    p.add_argument("--dim", type=positive_int, default=64)
    p.add_argument("--threads", type=positive_int, default=2, help="threads of the main table")
    p.add_argument("--scaling-threads", type=positive_int, nargs="*", default=None,
                   help="also time the chunk form and softmax, float32 and bfloat16, with these thread counts "
                        + default_text(DEFAULTS["scaling_threads"]))
    p.add_argument("--chunk-size", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timings are the best of this many runs " + default_text(DEFAULTS["repeats"]))
    p.add_argument("--small", action="store_true",
                   help="L = 256..2048, one repeat, no scaling run: about a minute (options given still apply)")
    p.add_argument("--out", type=out_folder, default=Path("outputs/benchmark/operator"))
    p.add_argument("--child", nargs=2, metavar=("IMPL", "L"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child and args.child[0] == "matmul":
        print(json.dumps({"gflops": matmul_gflops(args.threads)}))
        return
    if args.child:
        r = measure(args.child[0], int(args.child[1]), args.batch, args.heads, args.dim, args.threads,
                    args.chunk_size, args.repeats, ["fwd", "fwdbwd"])
        print(json.dumps(r))
        return
    fill_unset(args, args.small, **DEFAULTS)
    print(f"LION operator vs softmax attention: B={args.batch} H={args.heads} D={args.dim}, "
          f"{args.threads} threads, chunk {args.chunk_size}, best of {args.repeats}", flush=True)
    peaks = {t: run_child(argparse.Namespace(**dict(vars(args), threads=t)), "matmul", 0).get("gflops")
             for t in dict.fromkeys([args.threads] + args.scaling_threads)}
    for t, g in peaks.items():
        print(f"float32 matmul (2048^3), {t} threads: {fmt(g, 1)} GFLOP/s", flush=True)
    results: Dict[str, Dict[int, Dict]] = {impl: {} for impl in args.impls}
    scaling: Dict[int, Dict[str, Dict[int, Dict]]] = {args.threads: results}
    for threads in dict.fromkeys([args.threads] + args.scaling_threads):  # a thread count given twice runs once
        ns = argparse.Namespace(**dict(vars(args), threads=threads))
        impls = args.impls if threads == args.threads else [i for i in SCALING_IMPLS if i in args.impls]
        res = scaling.setdefault(threads, {impl: {} for impl in impls})
        for L in args.lengths:
            for impl in impls:
                res[impl][L] = r = run_child(ns, impl, L)
                print(f"  {threads} thr L={L:6d} {impl:9s} " + ("error: " + r["error"] if "error" in r else
                      f"fwd {fmt(r.get('fwd'))} s  fwd+bwd {fmt(r.get('fwdbwd'))} s  peak {fmt(r.get('peak_mib'))} MiB"),
                      flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    md = (f"{cpu_name()}; float32 matmul (2048^3): " + ", ".join(f"{fmt(g, 1)} GFLOP/s on {t} threads" for t, g in peaks.items())
          + f"; best of {args.repeats}\n\n" + table(results, args.lengths))
    if "chunk" in results and "sdpa" in results:
        md += "\n\nchunk form against softmax and against its own matmuls alone:\n\n" + ceiling_table(scaling, args.lengths)
    if all(i in results for i in ("chunk", "chunk_bf16", "sdpa", "sdpa_bf16")):
        md += ("\n\ninference in bfloat16 (inputs bf16; the chunk form's matmuls bf16, its states and normalisers "
               "float32):\n\n" + bf16_table(scaling, args.lengths))
    (args.out / "table.md").write_text(md + "\n")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "matmul_gflops": peaks, "results": results,
                                                       "scaling": scaling}, indent=1))
    print("\n" + md)
    if plot(results, args.out / "operator.png"):
        print(f"\nplot: {args.out / 'operator.png'}")
    print(f"table: {args.out / 'table.md'}")


if __name__ == "__main__":
    main()
