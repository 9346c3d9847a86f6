"""Benchmark of the LION encoders (``lion_lit``, ``lion_d``, ``lion_s``) against fairseq's ``roberta_base``
at the same size (12 layers, 768, 12 heads, FFN 3072, RoBERTa's 50265-word vocabulary), all built by
fairseq from their ``--arch`` as a user gets them: masked-LM training throughput (tokens/s of forward,
backward and an Adam step, 15% of tokens through the LM head) against sequence length, and the peak
memory of encoder inference. Every model runs with attention dropout 0, as ``benchmark.layer`` does:
RoBERTa's 0.1 would force torch's softmax attention off its fused kernel onto the L x L path (the layer
benchmark's ``softmax_ad`` column measures that cost), so like is compared with like.

    python -m lion_fairseq.benchmark.encoder              # train at L=128/512/2048, inference at 4096/16384
    python -m lion_fairseq.benchmark.encoder --small      # tiny models, short lengths: a one-minute check

Every (model, measurement, L) runs in a fresh process, so that the peak resident memory it reports (the
rise of ``ru_maxrss`` over the built model and its inputs) is its own. Besides wall-clock tokens/s it
reports tokens per CPU-second of the process, which other jobs on a shared machine disturb far less
(with ``--threads 1`` no thread spins while waiting, so CPU time is the work done). Writes a Markdown
table and a JSON file into ``--out``."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from .rss import maxrss_mib

MODELS = ("roberta_base", "lion_lit", "lion_d", "lion_s")
# the paper's MLM (Large) training time relative to BERT; LION-D is LION-RETNET
PAPER_RATIO = {"lion_lit": 0.95, "lion_d": 1.10, "lion_s": 1.32}
ROBERTA_VOCAB = 50265
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
            steps: int, device: str) -> Dict[str, Optional[float]]:
    """Run in the child process. ``train``: best seconds of one step and tokens/s; ``infer``: seconds
    and peak MiB of one forward pass (features only, batch 1) above the model's own memory."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, task = build(arch, L, vocab, form, chunk_size)
    model.to(device)
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
            base = maxrss_mib()
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            model(tokens, features_only=True)
        sync()
        out["infer_s"], out["infer_cpu_s"] = time.perf_counter() - t, time.process_time() - c
        peak = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else maxrss_mib()
        out["peak_mib"] = peak - base
    return out


def run_child(args: argparse.Namespace, arch: str, mode: str, L: int, batch: int) -> Dict:
    cmd = [sys.executable, "-m", "lion_fairseq.benchmark.encoder", "--child", arch, mode, str(L), str(batch),
           "--vocab", str(args.vocab), "--threads", str(args.threads), "--lion-form", args.lion_form,
           "--chunk-size", str(args.chunk_size), "--steps", str(args.steps), "--device", args.device]
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--train-lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--infer-lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=2048, help="tokens a training step (batch = tokens / L)")
    p.add_argument("--vocab", type=int, default=ROBERTA_VOCAB)
    p.add_argument("--lion-form", default="chunk", choices=("parallel", "chunk", "recurrent"))
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="timed training steps after one warm-up; best is kept")
    p.add_argument("--device", default="cpu", help="cpu or cuda (peak memory is then the CUDA allocator's)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per measurement before it is given up")
    p.add_argument("--small", action="store_true", help="the _tiny archs, L 128/512 and 1024: about a minute")
    p.add_argument("--out", type=Path, default=Path("outputs/benchmark/encoder"))
    p.add_argument("--child", nargs=4, metavar=("ARCH", "MODE", "L", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        arch, mode, L, batch = args.child
        r = measure(arch, mode, int(L), int(batch), args.vocab, args.threads, args.lion_form, args.chunk_size,
                    args.steps, args.device)
        print(json.dumps(r))
        return
    if args.small:
        args.models = ["roberta_base" if m == "roberta_base" else m + "_tiny" for m in args.models]
        args.train_lengths, args.infer_lengths, args.steps, args.vocab = [128, 512], [1024], 1, 1000
    if args.small and "roberta_base" in args.models:
        args.models = [m for m in args.models if m != "roberta_base"]
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


if __name__ == "__main__":
    main()
