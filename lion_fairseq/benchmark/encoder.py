"""Benchmark of the LION encoders (``lion_lit``, ``lion_d``, ``lion_s``) against fairseq's ``roberta_base``
at the same size (12 layers, 768, 12 heads, FFN 3072, RoBERTa's 50265-word vocabulary), all built by
fairseq from their ``--arch`` as a user gets them: masked-LM training throughput (tokens/s of forward,
backward and an Adam step, 15% of tokens through the LM head) against sequence length, and the peak
memory of encoder inference. Every model runs with attention dropout 0, as ``benchmark.layer`` does:
RoBERTa's 0.1 would force torch's softmax attention off its fused kernel onto the L x L path (the layer
benchmark's ``softmax_ad`` column measures that cost), so like is compared with like.

    python -m lion_fairseq.benchmark.encoder              # train at L=128/512/2048, inference at 4096/16384
    python -m lion_fairseq.benchmark.encoder --small      # tiny models, short lengths: a one-minute check
    python -m lion_fairseq.benchmark.encoder --long       # long-document encoding, L = 4K-64K, fp32 and bf16

``--long`` measures what long-document encoding costs: tokens/s and peak memory of one forward pass (one
sequence, features only) of ``lion_s`` in the chunk form and in the recurrent form (which runs each layer
block by block, so its memory does not grow with L), in float32 and cast to bfloat16 (``model.to(
torch.bfloat16)``, what fairseq's ``--bf16`` does to a model: every projection and the FFN run in
bfloat16; the LION operator computes in float32), against
``roberta_base`` (fused softmax attention) up to ``--softmax-max``; then the chunk form and ``roberta_base``
again on each of ``--scaling-threads`` (1 by default), up to ``--softmax-max``, for their thread scaling
(a form fast on one thread that does not scale loses on a server). Writes ``long.md``, ``long.json`` and ``long.png``.

Every (model, measurement, L) runs in a fresh process, so that the peak resident memory it reports (the
rise of ``ru_maxrss`` over the built model and its inputs) is its own. Besides wall-clock tokens/s it
reports tokens per CPU-second of the process, which other jobs on a shared machine disturb far less
(with ``--threads 1`` no thread spins while waiting, so CPU time is the work done). Writes a Markdown
table and a JSON file into ``--out``."""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from .operator import speedup, threads_name
from .options import default_text, fill_unset, out_folder, positive_int
from .rss import maxrss_mib, reset_peak

MODELS = ("roberta_base", "lion_lit", "lion_d", "lion_s")
# the paper's MLM (Large) training time relative to BERT; LION-D is LION-RETNET
PAPER_RATIO = {"lion_lit": 0.95, "lion_d": 1.10, "lion_s": 1.32}
ROBERTA_VOCAB = 50265
# the options that --small shortens unless given: (full run, --small)
DEFAULTS = {"train_lengths": ([128, 512, 2048], [128, 512]), "infer_lengths": ([4096, 16384], [1024]),
            "steps": (2, 1), "vocab": (ROBERTA_VOCAB, 1000)}
# like with like: LION has no attention weights to drop, and softmax attention keeps its fused kernel
ATTENTION_DROPOUT = 0.0


def build(arch: str, L: int, vocab: int, form: str, chunk_size: int):
    """The model fairseq-train builds for ``--task masked_lm --arch <arch> --attention-dropout 0``
    (positions for L tokens)."""
    import lion_fairseq  # noqa: F401  (registers the lion archs)
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    data = tempfile.mkdtemp()
    with open(os.path.join(data, "dict.txt"), "w") as f:
        f.writelines(f"w{i} 1\n" for i in range(vocab - 5))  # + <s> <pad> </s> <unk> <mask>
    argv = [data, "--task", "masked_lm", "--arch", arch, "--tokens-per-sample", str(L), "--max-positions", str(L),
            "--attention-dropout", str(ATTENTION_DROPOUT), "--cpu"]
    if arch.startswith("lion"):
        argv += ["--lion-form", form, "--lion-chunk-size", str(chunk_size)]
    parser = options.get_training_parser()
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, argv))
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model), task


def measure(arch: str, mode: str, L: int, batch: int, vocab: int, threads: int, form: str, chunk_size: int,
            steps: int, device: str, dtype: str = "fp32") -> Dict[str, Optional[float]]:
    """Run in the child process. ``train``: best seconds of one step and tokens/s; ``infer``: seconds
    (best and worst of ``steps`` passes) and peak MiB of a forward pass (features only, batch 1) above
    the model's own memory, the model in ``dtype`` (``fp32`` or ``bf16``)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, task = build(arch, L, vocab, form, chunk_size)
    model.to(device)
    if dtype == "bf16":
        if mode == "train":
            raise ValueError("--dtype bf16 is for inference (mode infer)")
        model.to(torch.bfloat16)
    d = task.source_dictionary
    tokens = torch.randint(d.nspecial + 1, len(d), (batch, L), device=device)
    tokens[:, 0] = d.bos()
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    out: Dict[str, Optional[float]] = {"params_M": sum(p.numel() for p in model.parameters()) / 1e6}
    if mode == "train":
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        masked = torch.rand(batch, L, device=device) < 0.15
        targets = tokens[masked]

        def step():
            logits, _ = model(tokens, masked_tokens=masked)
            loss = F.cross_entropy(logits.float(), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()  # warm-up: allocator, thread pools, Adam's state
        best, best_cpu = float("inf"), float("inf")
        for _ in range(steps):
            sync()
            t, c = time.perf_counter(), time.process_time()
            step()
            sync()
            best, best_cpu = min(best, time.perf_counter() - t), min(best_cpu, time.process_time() - c)
        out["step_s"], out["step_cpu_s"] = best, best_cpu
        out["tokens_per_s"] = batch * L / best
        out["tokens_per_cpu_s"] = batch * L / best_cpu
    else:
        model.eval()
        with torch.no_grad():  # one-time library set-up (thread pools, kernels) is not the model's memory
            model(tokens[:, :16], features_only=True)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2 ** 20
        else:
            gc.collect()
            reset_peak()
            base = maxrss_mib()
        times, cpu = [], []
        for _ in range(steps):
            t, c = time.perf_counter(), time.process_time()
            with torch.no_grad():
                model(tokens, features_only=True)
            sync()
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        out["infer_s"], out["infer_worst_s"], out["infer_cpu_s"] = min(times), max(times), min(cpu)
        out["tokens_per_s"] = L / min(times)
        peak = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else maxrss_mib()
        out["peak_mib"] = peak - base
    return out


def run_child(args: argparse.Namespace, arch: str, mode: str, L: int, batch: int, form: Optional[str] = None,
              dtype: str = "fp32") -> Dict:
    cmd = [sys.executable, "-m", "lion_fairseq.benchmark.encoder", "--child", arch, mode, str(L), str(batch),
           "--vocab", str(args.vocab), "--threads", str(args.threads), "--lion-form", form or args.lion_form,
           "--chunk-size", str(args.chunk_size), "--steps", str(args.steps), "--device", args.device,
           "--dtype", dtype]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {args.timeout} s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def tables(train: Dict[str, Dict[int, Dict]], infer: Dict[str, Dict[int, Dict]], args) -> str:
    md = [f"Training (forward + backward + Adam, {args.tokens} tokens a step, best of {args.steps}; "
          f"LION in the {args.lion_form} form, chunk {args.chunk_size}; attention dropout "
          f"{ATTENTION_DROPOUT:g} for every model):", "",
          "| L | model | tokens/s | tokens/CPU-s | step s | step CPU-s | CPU time vs roberta_base | "
          "paper's MLM time vs BERT |",
          "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for L in args.train_lengths:
        ref = train.get("roberta_base", {}).get(L, {}).get("step_cpu_s")
        for arch, per_len in train.items():
            r = per_len.get(L, {})
            if "error" in r:
                md.append(f"| {L} | {arch} | error: {r['error']} | | | | | |")
                continue
            ratio = f"{r['step_cpu_s'] / ref:.2f}" if ref and r.get("step_cpu_s") else "-"
            md.append(f"| {L} | {arch} | {fmt(r.get('tokens_per_s'))} | {fmt(r.get('tokens_per_cpu_s'))} | "
                      f"{fmt(r.get('step_s'))} | {fmt(r.get('step_cpu_s'))} | {ratio} | "
                      f"{PAPER_RATIO.get(arch.replace('_tiny', ''), '-')} |")
    md += ["", "Inference (features of one sequence, no grad): peak memory above the model's weights:", "",
           "| L | model | peak MiB | seconds | CPU-s |", "|---:|---|---:|---:|---:|"]
    for L in args.infer_lengths:
        for arch, per_len in infer.items():
            r = per_len.get(L, {})
            if "error" in r:
                md.append(f"| {L} | {arch} | error: {r['error']} | | |")
            else:
                md.append(f"| {L} | {arch} | {fmt(r.get('peak_mib'))} | {fmt(r.get('infer_s'))} | "
                          f"{fmt(r.get('infer_cpu_s'))} |")
    return "\n".join(md)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.encoder", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--train-lengths", type=positive_int, nargs="+", default=None,
                   help=default_text(DEFAULTS["train_lengths"]))
    p.add_argument("--infer-lengths", type=positive_int, nargs="+", default=None,
                   help=default_text(DEFAULTS["infer_lengths"]))
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens a training step (batch = tokens / L)")
    p.add_argument("--vocab", type=positive_int, default=None, help=default_text(DEFAULTS["vocab"]))
    p.add_argument("--lion-form", default="chunk", choices=("parallel", "chunk", "recurrent"))
    p.add_argument("--chunk-size", type=positive_int, default=64)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed training steps after one warm-up; best is kept " + default_text(DEFAULTS["steps"]))
    p.add_argument("--device", default="cpu", help="cpu or cuda (peak memory is then the CUDA allocator's)")
    p.add_argument("--timeout", type=positive_int, default=1800, help="seconds per measurement before it is given up")
    p.add_argument("--small", action="store_true",
                   help="the _tiny archs (no roberta_base), L 128/512 and 1024: about a minute (options given still "
                        "apply)")
    p.add_argument("--long", action="store_true", help="long-document encoding (see above) instead")
    p.add_argument("--long-lengths", type=positive_int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--softmax-max", type=positive_int, default=16384, help="--long: the longest L roberta_base runs at")
    p.add_argument("--scaling-threads", type=positive_int, nargs="*", default=[1],
                   help="--long: also run the chunk form and roberta_base with these thread counts (none: no "
                        "scaling run)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=out_folder, default=Path("outputs/benchmark/encoder"))
    p.add_argument("--child", nargs=4, metavar=("ARCH", "MODE", "L", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.long and args.small:  # long_document takes neither: it would start the whole run
        p.error("--small does not shorten --long: pass --long-lengths (and --softmax-max) instead")
    fill_unset(args, args.small, **DEFAULTS)
    if args.child:
        arch, mode, L, batch = args.child
        r = measure(arch, mode, int(L), int(batch), args.vocab, args.threads, args.lion_form, args.chunk_size,
                    args.steps, args.device, args.dtype)
        print(json.dumps(r))
        return
    if args.long:
        long_document(args)
        return
    if args.small:  # roberta_base has no tiny size beside the LION archs'
        args.models = [m + "_tiny" for m in args.models if m != "roberta_base"]
    print(f"LION encoders vs roberta_base: {args.threads} threads on {args.device}, vocab {args.vocab}, "
          f"LION form {args.lion_form} (chunk {args.chunk_size})", flush=True)
    train: Dict[str, Dict[int, Dict]] = {a: {} for a in args.models}
    infer: Dict[str, Dict[int, Dict]] = {a: {} for a in args.models}
    for L in args.train_lengths:
        for arch in args.models:
            train[arch][L] = r = run_child(args, arch, "train", L, max(1, args.tokens // L))
            print(f"  train L={L:6d} {arch:14s} " + (f"error: {r['error']}" if "error" in r else
                  f"{fmt(r['tokens_per_s'])} tokens/s, {fmt(r['tokens_per_cpu_s'])} tokens/CPU-s "
                  f"({fmt(r['step_s'])} s a step)"), flush=True)
    for L in args.infer_lengths:
        for arch in args.models:
            infer[arch][L] = r = run_child(args, arch, "infer", L, 1)
            print(f"  infer L={L:6d} {arch:14s} " + (f"error: {r['error']}" if "error" in r else
                  f"peak {fmt(r['peak_mib'])} MiB, {fmt(r['infer_s'])} s"), flush=True)
    md = tables(train, infer, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(md + "\n")
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "train": train, "infer": infer}, indent=1))
    print("\n" + md + f"\n\ntable: {args.out / 'table.md'}")


# (name, arch, form) of the long-document comparison; each runs in fp32 and bf16
LONG_SERIES = (("lion_s chunk", "lion_s", "chunk"), ("lion_s recurrent", "lion_s", "recurrent"),
               ("roberta_base", "roberta_base", None))
# the series whose speed-up the README quotes, run again on each of --scaling-threads
SCALING_SERIES = tuple(s for s in LONG_SERIES if s[0] in ("lion_s chunk", "roberta_base"))


def scaling_table(scaling: Dict[int, Dict[str, Dict[int, Dict]]], lengths: List[int]) -> List[str]:
    """Tokens/s of each (series, dtype) on each thread count (the first is the main run's), the gain from
    the fewest threads to the most, and the speed-up against roberta_base in the same dtype on each count."""
    counts = list(scaling)
    few, most = min(counts), max(counts)
    head = ["L", "model", "dtype"] + [f"tokens/s, {threads_name(t)}" for t in counts] + \
        [f"gain from {few} to {threads_name(most)}"] + [f"vs roberta_base, {threads_name(t)}" for t in counts]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|---|" + "---:|" * (len(head) - 3)]
    seconds = lambda t, key, L: scaling[t].get(key, {}).get(L, {}).get("infer_s")  # noqa: E731
    for L in lengths:
        for name, _, _ in SCALING_SERIES:
            for dtype in ("fp32", "bf16"):
                key = f"{name} {dtype}"
                rates = [fmt(L / s) if s else "-" for s in (seconds(t, key, L) for t in counts)]
                vs = [speedup(seconds(t, f"roberta_base {dtype}", L), seconds(t, key, L)) for t in counts]
                lines.append(f"| {L} | {name} | {dtype} | " + " | ".join(rates) +
                             f" | {speedup(seconds(few, key, L), seconds(most, key, L))} | " + " | ".join(vs) + " |")
    return lines


def long_document(args: argparse.Namespace) -> None:
    """``--long``: one forward pass per (series, dtype, L), each in a fresh process."""
    import torch

    from .operator import cpu_name, matmul_gflops
    from .plotting import against_length, pyplot

    rates = {d: matmul_gflops(args.threads, dtype=t) for d, t in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    head = (f"Long-document encoding: one sequence, features of a forward pass, best (worst) of {args.steps}; "
            f"{args.threads} threads on {args.device} ({cpu_name()}); 2048^3 matmul {rates['fp32']:.0f} GFLOP/s fp32, "
            f"{rates['bf16']:.0f} bf16; vocab {args.vocab}, LION chunk {args.chunk_size}")
    print(head, flush=True)
    rows: Dict[str, Dict[int, Dict]] = {}
    for name, arch, form in LONG_SERIES:
        for dtype in ("fp32", "bf16"):
            key = f"{name} {dtype}"
            rows[key] = {}
            for L in args.long_lengths:
                if arch == "roberta_base" and L > args.softmax_max:
                    continue
                rows[key][L] = r = run_child(args, arch, "infer", L, 1, form=form, dtype=dtype)
                print(f"  L={L:6d} {key:24s} " + (f"error: {r['error']}" if "error" in r else
                      f"{fmt(r['tokens_per_s'])} tokens/s ({fmt(r['infer_s'])}-{fmt(r['infer_worst_s'])} s), "
                      f"peak {fmt(r['peak_mib'])} MiB"), flush=True)
    md = [head + ":", "", "| L | model | dtype | tokens/s | seconds (best-worst) | peak MiB | bf16 speed-up | vs roberta_base |",
          "|---:|---|---|---:|---:|---:|---:|---:|"]
    for L in args.long_lengths:
        for name, _, _ in LONG_SERIES:
            for dtype in ("fp32", "bf16"):
                r = rows[f"{name} {dtype}"].get(L)
                if r is None:
                    continue
                if "error" in r:
                    md.append(f"| {L} | {name} | {dtype} | error: {r['error']} | | | | |")
                    continue
                fp32 = rows[f"{name} fp32"].get(L, {})
                soft = rows[f"roberta_base {dtype}"].get(L, {})
                up = f"{fp32['infer_s'] / r['infer_s']:.2f}x" if dtype == "bf16" and fp32.get("infer_s") else "-"
                vs = f"{soft['infer_s'] / r['infer_s']:.2f}x" if soft.get("infer_s") else "-"
                md.append(f"| {L} | {name} | {dtype} | {fmt(r['tokens_per_s'])} | {fmt(r['infer_s'])}-"
                          f"{fmt(r['infer_worst_s'])} | {fmt(r['peak_mib'])} | {up} | {vs} |")
    scaling_lengths = [L for L in args.long_lengths if L <= args.softmax_max]
    keys = [f"{name} {dtype}" for name, _, _ in SCALING_SERIES for dtype in ("fp32", "bf16")]
    scaling = {args.threads: {k: {L: rows[k][L] for L in scaling_lengths} for k in keys}}
    scaling_rates = {}
    for threads in dict.fromkeys(args.scaling_threads):
        if threads == args.threads:
            continue
        ns = argparse.Namespace(**dict(vars(args), threads=threads))
        scaling_rates[threads] = {d: matmul_gflops(threads, dtype=t) for d, t in (("fp32", torch.float32),
                                                                                   ("bf16", torch.bfloat16))}
        scaling[threads] = {}
        for name, arch, form in SCALING_SERIES:
            for dtype in ("fp32", "bf16"):
                key = f"{name} {dtype}"
                scaling[threads][key] = {}
                for L in scaling_lengths:
                    scaling[threads][key][L] = r = run_child(ns, arch, "infer", L, 1, form=form, dtype=dtype)
                    print(f"  L={L:6d} {key:24s} {threads_name(threads)}: " + (f"error: {r['error']}" if "error" in r
                          else f"{fmt(r['tokens_per_s'])} tokens/s"), flush=True)
    if len(scaling) > 1:
        md += ["", "Thread scaling (the same passes on " + ", ".join(
            f"{threads_name(t)}, 2048^3 matmul {g['fp32']:.0f} GFLOP/s fp32, {g['bf16']:.0f} bf16"
            for t, g in scaling_rates.items()) +
            f"; the {threads_name(args.threads)} column is the table's above):", "",
            *scaling_table(scaling, scaling_lengths)]
    text = "\n".join(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long.md").write_text(text + "\n")
    (args.out / "long.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                    "matmul_gflops": rates, "rows": rows, "scaling": scaling,
                                                    "scaling_matmul_gflops": scaling_rates}, indent=1))
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        against_length(axes[0], rows, "tokens_per_s", "tokens/s, one sequence (higher is better)", dashed="bf16")
        against_length(axes[1], rows, "peak_mib", "peak MiB above the weights", dashed="bf16")
        fig.tight_layout()
        fig.savefig(args.out / "long.png", dpi=110)
        plt.close(fig)
    print("\n" + text + f"\n\ntable: {args.out / 'long.md'}")


if __name__ == "__main__":
    main()
