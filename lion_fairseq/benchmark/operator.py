"""Benchmark of the LION operator's forms against softmax attention (``scaled_dot_product_attention``,
what fairseq's layers compute) at the same shape: time of forward and of forward+backward, and the peak
memory of inference, against sequence length.

    python -m lion_fairseq.benchmark.operator                 # B=1, H=12, D=64, L=256..16384, 2 threads
    python -m lion_fairseq.benchmark.operator --small         # a one-minute run (the README's demo)

Each (implementation, L) runs in a fresh process, so that the peak resident memory it reports (the
rise of ``ru_maxrss`` over the inputs) is its own. Writes a Markdown table, a JSON file and a log-log
plot into ``--out``."""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .plotting import against_length, pyplot
from .rss import maxrss_mib

IMPLS = ("sdpa", "parallel", "chunk", "recurrent")
# beyond these lengths a run would not fit this machine's memory (the L x L forms) or take minutes
# (autograd through the recurrent form's token loop stores a D x D state per token)
LIMITS = {("parallel", "fwd"): 8192, ("parallel", "fwdbwd"): 4096, ("recurrent", "fwdbwd"): 2048}


def chunk_flops(batch: int, heads: int, L: int, dk: int, dv: int, C: int) -> Dict[str, float]:
    """Multiply-adds x 2 of the bidirectional, normalised chunk form (the normaliser is one more column of
    v): per head, forward ``2LC(Dk+Dv) + 8L Dk Dv`` (the shared intra-chunk product and two directions'
    states), backward ``2LC(3Dk+2Dv) + 24L Dk Dv``."""
    dv = dv + 1
    fwd = 2 * L * C * (dk + dv) + 8 * L * dk * dv
    bwd = 2 * L * C * (3 * dk + 2 * dv) + 24 * L * dk * dv
    return {"fwd": batch * heads * fwd, "fwdbwd": batch * heads * (fwd + bwd)}


def matmul_gflops(threads: int, n: int = 2048, repeats: int = 3) -> float:
    """This machine's float32 matmul rate with ``threads`` threads: the ceiling for the chunk form."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


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
    inputs = [q, k, v, log_f, log_b]

    if impl == "sdpa":
        def run(x):
            return F.scaled_dot_product_attention(x[0], x[1], x[2])
    else:
        from lion_fairseq.ops import lion_attention

        def run(x):
            return lion_attention(*x, form=impl, chunk_size=chunk_size)

    out: Dict[str, Optional[float]] = {}
    with torch.no_grad():  # one-time set-up of the libraries (thread pools, kernels) is not the form's memory
        run([x[..., :16, :] if x.dim() == 4 else x[..., :16] for x in inputs])
    base = maxrss_mib()
    with torch.no_grad():
        run(inputs)
    out["peak_mib"] = maxrss_mib() - base
    for mode in modes:
        if L > LIMITS.get((impl, mode), 1 << 30):
            out[mode] = None
            continue
        best = float("inf")
        for _ in range(repeats):
            if mode == "fwd":
                t = time.perf_counter()
                with torch.no_grad():
                    run(inputs)
                best = min(best, time.perf_counter() - t)
            else:
                leaves = [x.clone().requires_grad_() for x in inputs]
                t = time.perf_counter()
                run(leaves).sum().backward()
                best = min(best, time.perf_counter() - t)
        out[mode] = best
    if impl == "chunk":
        flops = chunk_flops(batch, heads, L, dim, dim, min(chunk_size, L))
        for mode in modes:
            out[f"gflops_{mode}"] = flops[mode] / out[mode] / 1e9
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


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timings are the best of this many runs")
    p.add_argument("--small", action="store_true", help="L = 256..2048, one repeat: about a minute")
    p.add_argument("--out", type=Path, default=Path("outputs/benchmark/operator"))
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
    if args.small:
        args.lengths, args.repeats = [256, 512, 1024, 2048], 1
    print(f"LION operator vs softmax attention: B={args.batch} H={args.heads} D={args.dim}, "
          f"{args.threads} threads, chunk {args.chunk_size}, best of {args.repeats}", flush=True)
    peak = run_child(args, "matmul", 0).get("gflops")
    if peak:
        print(f"float32 matmul (2048^3): {peak:.1f} GFLOP/s", flush=True)
    results: Dict[str, Dict[int, Dict]] = {impl: {} for impl in args.impls}
    for L in args.lengths:
        for impl in args.impls:
            results[impl][L] = r = run_child(args, impl, L)
            print(f"  L={L:6d} {impl:9s} " + ("error: " + r["error"] if "error" in r else
                  f"fwd {fmt(r.get('fwd'))} s  fwd+bwd {fmt(r.get('fwdbwd'))} s  peak {fmt(r.get('peak_mib'))} MiB"),
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    md = table(results, args.lengths)
    if "chunk" in results and peak:
        md += "\n\nchunk form's achieved rate (float32 matmul on this machine: %.1f GFLOP/s):\n\n" % peak
        md += "| L | fwd GFLOP/s | fwd+bwd GFLOP/s | fwd+bwd share of matmul |\n|---:|---:|---:|---:|\n"
        for L, r in sorted(results["chunk"].items()):
            if r.get("gflops_fwdbwd"):
                md += (f"| {L} | {r['gflops_fwd']:.1f} | {r['gflops_fwdbwd']:.1f} | "
                       f"{100 * r['gflops_fwdbwd'] / peak:.0f}% |\n")
    (args.out / "table.md").write_text(md + "\n")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "matmul_gflops": peak, "results": results}, indent=1))
    print("\n" + md)
    if plot(results, args.out / "operator.png"):
        print(f"\nplot: {args.out / 'operator.png'}")
    print(f"table: {args.out / 'table.md'}")


if __name__ == "__main__":
    main()
