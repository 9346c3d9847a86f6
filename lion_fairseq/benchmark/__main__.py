"""The side-by-side benchmark, in one run on the same inputs:

1. this machine's float32 matmul rate, the ceiling on CPU;
2. the chunk form's chunk size: the operator (B=1, H=12, D=64, per-token gates, bidirectional) at
   L=4096 for each candidate size, forward+backward; the fastest is the one reported and used below;
3. the chunk operator's achieved FLOP/s against that ceiling, at L = 1024, 4096, 16384;
4. one encoder layer at RoBERTa-base width (``benchmark/layer.py``): LION-LIT, -D and -S in each form
   against fairseq's softmax ``TransformerEncoderLayer``, forward+backward, forward, and inference peak
   memory, L = 128 ... 16384, batch 1;
5. LM decoding time per token against context length, ``lion_s_lm`` against ``transformer_lm``
   (``benchmark/decode.py``), on one thread (a batch-1 step is many small ops) and on ``--threads``;
6. thread scaling: softmax and each LION layer's chunk form, forward+backward at
   L = 8192 and 16384, again on each of ``--scaling-threads`` (1 by default), beside the main run's;
7. the defaults these numbers choose for ``--lion-form`` and ``--lion-chunk-size``.

    python -m lion_fairseq.benchmark              # everything: about 20 minutes on 2 cores
    python -m lion_fairseq.benchmark --small      # L up to 1024, no decoding: a couple of minutes

Each (layer, form, L) runs in a fresh process so that the memory it reports is its own. Writes
``benchmark.md``, ``benchmark.json`` and ``benchmark.png`` (time and memory against L, log-log, a row of
plots per variant) into ``--out``."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from . import operator as op
from .layer import LIMITS
from .operator import fmt, speedup, threads_name
from .options import default_text, fill_unset, out_folder, positive_int
from .plotting import against_length, pyplot

FORMS = ("chunk", "parallel", "recurrent")
VARIANTS = ("lit", "d", "s")
LENGTHS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
CHUNK_SIZES = [32, 64, 128]
FLOP_LENGTHS = [1024, 4096, 16384]
DECODE_LENGTHS = [64, 1024, 4096, 16384]
SCALING_LENGTHS = [8192, 16384]
# the options that --small shortens unless given: (full run, --small)
DEFAULTS = {"lengths": (LENGTHS, [128, 256, 512, 1024]), "decode_lengths": (DECODE_LENGTHS, [])}
# the layers whose speed-ups the README quotes, timed again on each thread count
SCALING_CONFIGS = [("softmax", "softmax", "chunk")] + [(f"lion_{v} chunk", v, "chunk") for v in VARIANTS]


def layer_child(kind: str, form: str, L: int, threads: int, chunk_size: int, repeats: int) -> Dict:
    cmd = [sys.executable, "-m", "lion_fairseq.benchmark.layer", kind, form, str(L), "--threads", str(threads),
           "--chunk-size", str(chunk_size), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if proc.returncode != 0:  # e.g. killed for memory: recorded, the run goes on
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def configs() -> List[tuple]:
    """(name, kind, form) of every layer measured: softmax twice, each LION variant in each form."""
    out = [("softmax", "softmax", "chunk"), ("softmax (attn dropout 0.1)", "softmax_ad", "chunk")]
    return out + [(f"lion_{v} {f}", v, f) for v in VARIANTS for f in FORMS]


def cell(r: Dict, key: str) -> str:
    if "error" in r:
        return "failed"
    return fmt(r.get(key), 1 if key == "peak_mib" else 3)


def layer_tables(results: Dict[str, Dict[int, Dict]], lengths: List[int]) -> str:
    names = list(results)
    out = []
    for key, title in (("fwdbwd", "forward+backward, s"), ("fwd", "forward (inference), s"),
                       ("peak_mib", "inference peak memory above the layer and its input, MiB")):
        out += [f"**{title}**", "", "| L | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for L in lengths:
            out.append(f"| {L} | " + " | ".join(cell(results[n].get(L, {}), key) for n in names) + " |")
        out.append("")
    return "\n".join(out)


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``, None where either was not measured (or den is 0)."""
    return num / den if num is not None and den else None


def met(got: Optional[float], ok: bool) -> str:
    return "not measured" if got is None else "yes" if ok else "no"


def targets(results: Dict[str, Dict[int, Dict]], flops: Dict[int, Dict], peak_gflops: Optional[float],
            decode: Optional[Dict]) -> List[str]:
    soft = results["softmax"]
    lines = ["| target | measured | met |", "|---|---|---|"]
    for L, want in ((8192, 1.6), (16384, 3.0)):
        for name in ("lion_lit chunk", "lion_d chunk", "lion_s chunk"):
            got = ratio(soft.get(L, {}).get("fwdbwd"), results[name].get(L, {}).get("fwdbwd"))
            lines.append(f"| {name} layer fwd+bwd at L={L} at least {want}x faster than softmax | "
                         f"{fmt(got, 2)}x | {met(got, got is not None and got >= want)} |")
    for name in ("lion_lit recurrent", "lion_d recurrent", "lion_s recurrent", "lion_s chunk"):
        got = ratio(results[name].get(16384, {}).get("peak_mib"), soft.get(16384, {}).get("peak_mib"))
        share = 100 * got if got is not None else None
        lines.append(f"| {name} layer inference peak memory at L=16384 at most 25% of softmax's | "
                     f"{fmt(share, 0)}% | {met(got, got is not None and got <= 0.25)} |")
    lion = (decode or {}).get("decode", {}).get("lion", {})
    first, last = str(DECODE_LENGTHS[0]), str(DECODE_LENGTHS[-1])
    got = ratio(lion[last]["per_token_s"], lion[first]["per_token_s"]) if first in lion and last in lion else None
    lines.append(f"| lion_s_lm decode time per token at context {last} within 10% of context {first} | "
                 f"{fmt(got)}x | {met(got, got is not None and got <= 1.10)} |")
    for L, r in sorted(flops.items()):
        if L >= 4096 and r.get("gflops_fwdbwd") and peak_gflops:
            share = r["gflops_fwdbwd"] / peak_gflops
            lines.append(f"| chunk operator fwd+bwd at L={L} at least 30% of matmul FLOP/s | {100 * share:.0f}% | "
                         f"{'yes' if share >= 0.30 else 'no'} |")
    return lines


def choose_form(results: Dict[str, Dict[int, Dict]], lengths: List[int]) -> List[str]:
    """Which form trains fastest (fwd+bwd) and which infers in the least memory, at each L, for LION-S."""
    lines = []
    for L in lengths:
        per = {f: results[f"lion_s {f}"].get(L, {}) for f in FORMS}
        train, fast, small = (min((f for f in FORMS if per[f].get(key) is not None), key=lambda f: per[f][key],
                                  default="-") for key in ("fwdbwd", "fwd", "peak_mib"))
        lines.append(f"| {L} | {train} | {fast} | {small} |")
    return ["| L | fastest training (fwd+bwd) | fastest inference | least inference memory |",
            "|---:|---|---|---|"] + lines


def scaling_table(scaling: Dict[int, Dict[str, Dict[int, Dict]]], lengths: List[int]) -> List[str]:
    """Forward+backward of each layer on each thread count (the first is the main run's), the gain from
    the fewest threads to the most, and the speed-up against softmax on each count."""
    counts = list(scaling)
    few, most = min(counts), max(counts)
    head = ["L", "layer"] + [f"fwd+bwd s, {threads_name(t)}" for t in counts] + \
        [f"gain from {few} to {threads_name(most)}"] + [f"vs softmax, {threads_name(t)}" for t in counts]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|" * (len(head) - 2)]
    for L in lengths:
        for name, _, _ in SCALING_CONFIGS:
            secs = [scaling[t].get(name, {}).get(L, {}).get("fwdbwd") for t in counts]
            gain = speedup(scaling[few].get(name, {}).get(L, {}).get("fwdbwd"),
                           scaling[most].get(name, {}).get(L, {}).get("fwdbwd"))
            vs = [speedup(scaling[t].get("softmax", {}).get(L, {}).get("fwdbwd"), x) for t, x in zip(counts, secs)]
            lines.append(f"| {L} | {name} | " + " | ".join(fmt(x) for x in secs) + f" | {gain} | " +
                         " | ".join(vs) + " |")
    return lines


def plot(results: Dict[str, Dict[int, Dict]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(len(VARIANTS), 3, figsize=(16, 4.2 * len(VARIANTS)), squeeze=False)
    for row, v in zip(axes, VARIANTS):
        names = ["softmax", "softmax (attn dropout 0.1)"] + [f"lion_{v} {f}" for f in FORMS]
        for ax, key, title in zip(row, ("fwdbwd", "fwd", "peak_mib"),
                                  ("forward + backward (s)", "forward, inference (s)", "inference peak memory (MiB)")):
            against_length(ax, {n: results[n] for n in names}, key, f"LION-{v.upper()} layer: {title}", "softmax")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                   help="the layers' lengths " + default_text(DEFAULTS["lengths"]))
    p.add_argument("--decode-lengths", type=positive_int, nargs="*", default=None,
                   help="decoding's context lengths, none given: no decoding " + default_text(DEFAULTS["decode_lengths"]))
    p.add_argument("--repeats", type=positive_int, default=2, help="timings are the best of this many runs")
    p.add_argument("--scaling-threads", type=positive_int, nargs="*", default=[1],
                   help="also time softmax and the LION chunk layers at L = 8192 and 16384, and decoding, "
                        "with these thread counts (none: no scaling run)")
    p.add_argument("--small", action="store_true",
                   help="L up to 1024, no decode: a couple of minutes (options given still apply)")
    p.add_argument("--out", type=out_folder, default=Path("outputs/benchmark"))
    args = p.parse_args(argv)
    flop_lengths, sizes = ([1024] if args.small else FLOP_LENGTHS), CHUNK_SIZES
    fill_unset(args, args.small, **DEFAULTS)
    scaling_lengths = [L for L in SCALING_LENGTHS if L in args.lengths] or args.lengths[-1:]
    scaling_threads = [t for t in dict.fromkeys(args.scaling_threads) if t != args.threads]
    args.out.mkdir(parents=True, exist_ok=True)
    say = lambda s: print(s, flush=True)  # noqa: E731

    ns = argparse.Namespace(batch=1, heads=12, dim=64, threads=args.threads, repeats=2, chunk_size=64)
    matmul = op.run_child(ns, "matmul", 0)
    peak = matmul.get("gflops")
    say(f"float32 matmul, {args.threads} threads: " + (f"error: {matmul['error']}" if "error" in matmul else
                                                        f"{fmt(peak, 1)} GFLOP/s"))

    sweep_L = 4096 if not args.small else 1024
    sweep = {}
    ns.repeats = 5  # cheap at this size, and two-thread timings here swing by 15%
    for C in sizes:
        ns.chunk_size = C
        sweep[C] = op.run_child(ns, "chunk", sweep_L)
        say(f"chunk operator, L={sweep_L}, chunk {C}: " + (f"error: {sweep[C]['error']}" if "error" in sweep[C] else
                                                            f"fwd+bwd {fmt(sweep[C].get('fwdbwd'))} s"))
    if not any(r.get("fwdbwd") for r in sweep.values()):
        sys.exit("the chunk operator ran at no chunk size (errors above): nothing to benchmark with")
    # the smallest size within 5% of the fastest: timings closer than that are noise here, and a smaller
    # chunk does fewer multiply-adds and holds less
    fastest = min(r["fwdbwd"] for r in sweep.values() if r.get("fwdbwd"))
    chunk_size = min(C for C in sizes if sweep[C].get("fwdbwd") and sweep[C]["fwdbwd"] <= 1.05 * fastest)
    ns.repeats = 2
    ns.chunk_size = chunk_size
    flops = {}
    for L in flop_lengths:
        flops[L] = sweep[chunk_size] if L == sweep_L else op.run_child(ns, "chunk", L)
        say(f"chunk operator, L={L}: {fmt(flops[L].get('gflops_fwdbwd'), 1)} GFLOP/s fwd+bwd")

    results: Dict[str, Dict[int, Dict]] = {name: {} for name, _, _ in configs()}
    for L in args.lengths:
        for name, kind, form in configs():
            r = layer_child(kind, form, L, args.threads, chunk_size, args.repeats)
            results[name][L] = r
            say(f"layer L={L:6d} {name:28s} " + (f"error: {r['error']}" if "error" in r else
                f"fwd+bwd {fmt(r.get('fwdbwd'))} s  fwd {fmt(r.get('fwd'))} s  peak {fmt(r.get('peak_mib'), 1)} MiB"))

    scaling: Dict[int, Dict[str, Dict[int, Dict]]] = {
        args.threads: {name: {L: results[name][L] for L in scaling_lengths} for name, _, _ in SCALING_CONFIGS}}
    for threads in scaling_threads:
        scaling[threads] = {name: {} for name, _, _ in SCALING_CONFIGS}
        for L in scaling_lengths:
            for name, kind, form in SCALING_CONFIGS:
                r = scaling[threads][name][L] = layer_child(kind, form, L, threads, chunk_size, args.repeats)
                say(f"layer L={L:6d} {name:28s} {threads_name(threads)}: " +
                    (f"error: {r['error']}" if "error" in r else f"fwd+bwd {fmt(r.get('fwdbwd'))} s"))

    # one thread is decoding's main run (its target's figure); the other counts are its scaling
    decodes: Dict[int, Dict] = {}
    for threads in dict.fromkeys([1, args.threads] + scaling_threads) if args.decode_lengths else []:
        out = args.out / ("decode" if threads == 1 else f"decode_{threads}_threads")
        subprocess.run([sys.executable, "-m", "lion_fairseq.benchmark.decode",
                        "--lengths", *map(str, args.decode_lengths),
                        "--steps", "64", "--score-blocks", "2048", "--threads", str(threads), "--out", str(out)],
                       check=False, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if (out / "decode.json").exists():
            decodes[threads] = {"json": json.loads((out / "decode.json").read_text()),
                                "md": (out / "decode.md").read_text()}
    decode = decodes.get(1, {}).get("json")

    md = [f"Machine: float32 matmul {fmt(peak, 1)} GFLOP/s on {args.threads} threads; batch 1, "
          f"best of {args.repeats}. `-`: not run (past a memory or time limit: {LIMITS}).", "",
          f"**Chunk size** (operator fwd+bwd at L={sweep_L}, best of 5, s): " +
          ", ".join(f"{C}: {fmt(sweep[C].get('fwdbwd'))}" for C in sizes) +
          f" -> **{chunk_size}** (the smallest within 5% of the fastest)", "",
          f"**Chunk operator's achieved rate** (fwd+bwd, chunk {chunk_size}):", "", "| L | GFLOP/s | share of matmul |", "|---:|---:|---:|"]
    md += [f"| {L} | {fmt(r.get('gflops_fwdbwd'), 1)} | {100 * r['gflops_fwdbwd'] / peak:.0f}% |"
           for L, r in sorted(flops.items()) if r.get("gflops_fwdbwd") and peak]
    md += ["", "**One encoder layer** (768 wide, 12 heads, FFN 3072):", "", layer_tables(results, args.lengths),
           "**Form by length** (LION-S):", "", *choose_form(results, args.lengths), ""]
    if len(scaling) > 1:
        md += [f"**Thread scaling** (one layer, forward+backward; the {args.threads}-thread column is the main "
               "run's):", "", *scaling_table(scaling, scaling_lengths), ""]
    for threads, d in decodes.items():
        md += [f"**Decoding, {threads_name(threads)}** (from `benchmark/decode.py`):", "", d["md"]]
    md += ["**Targets**:", "", *targets(results, flops, peak, decode), ""]
    text = "\n".join(md) + "\n"
    (args.out / "benchmark.md").write_text(text)
    (args.out / "benchmark.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "matmul_gflops": peak, "chunk_size_sweep": sweep,
         "chosen_chunk_size": chunk_size, "chunk_flops": flops, "layer": results, "scaling": scaling,
         "decode": {t: d["json"] for t, d in decodes.items()}}, indent=1))
    say("\n" + text)
    if plot(results, args.out / "benchmark.png"):
        say(f"plot: {args.out / 'benchmark.png'}")
    say(f"table: {args.out / 'benchmark.md'}")


if __name__ == "__main__":
    main()
