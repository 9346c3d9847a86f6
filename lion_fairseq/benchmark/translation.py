"""Translation with LION (``lion_transformer``) against fairseq's ``transformer``, two measurements:

    python -m lion_fairseq.benchmark.translation quality    # learning, side by side, ~10 min on 2 cores
    python -m lion_fairseq.benchmark.translation decode     # time per target token, ~5 min

``quality``: a synthetic task with a known answer (the target is the source reversed, each word mapped
through a fixed permutation: ``write_reversal_corpus``), the same tiny size (2 + 2 layers, 128 wide, 2
heads, FFN 256), updates, batch and optimiser for every model, through ``fairseq-train`` and
``fairseq-generate`` (beam 4); reports exact-match and BLEU on the test split for each model, two at a time
on one thread each.

``decode``: base size (6 + 6 layers, 512, 8 heads, FFN 2048), batch 1, float32, one thread, untrained
weights (speed does not depend on them): the source of S tokens is encoded once, then T target tokens
are decoded through each decoder's ``incremental_state`` as fairseq's generator calls it; reports the
median time of the 8 steps up to target positions 16, 256 and 1024, the size of the decoding state (keys and
values cached by softmax attention, ``(S, z)`` for LION) after 1024 tokens, and the peak RSS of the process
(one per model and source length: Python, torch, the weights and everything decoding held). Writes ``{what}.md`` and
``{what}.json`` (``quality`` or ``decode``) into ``--out``."""
import argparse
import json
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .options import out_folder
from .rss import maxrss_mib

WORDS = 30
# (name, arch, extra options): fairseq's transformer and LION at the same size
TINY = dict(encoder_embed_dim=128, encoder_ffn_embed_dim=256, encoder_layers=2, encoder_attention_heads=2,
            decoder_embed_dim=128, decoder_ffn_embed_dim=256, decoder_layers=2, decoder_attention_heads=2)
QUALITY_MODELS = [("transformer", "transformer", []),
                  ("lion_lit", "lion_lit_transformer_tiny", []),
                  ("lion_d", "lion_d_transformer_tiny", []),
                  ("lion_s", "lion_s_transformer_tiny", []),
                  ("lion_s linear cross-attn", "lion_s_transformer_tiny", ["--lion-cross-attention", "linear"])]
DECODE_MODELS = [("transformer", "transformer", []),
                 ("lion_s", "lion_s_transformer", []),
                 ("lion_s linear cross-attn", "lion_s_transformer", ["--lion-cross-attention", "linear"])]


def write_reversal_corpus(root: Path, sizes=(("train", 1500), ("valid", 60), ("test", 40)), seed: int = 0) -> None:
    """``{split}.src`` / ``{split}.tgt``: sources of 3-12 words ``w0..w29``; each target is the source
    reversed, word i written ``t<perm[i]>``."""
    rng = random.Random(seed)
    perm = list(range(WORDS))
    rng.shuffle(perm)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in sizes:
        src, tgt = [], []
        for _ in range(n):
            words = [rng.randrange(WORDS) for _ in range(rng.randint(3, 12))]
            src.append(" ".join(f"w{i}" for i in words))
            tgt.append(" ".join(f"t{perm[i]}" for i in reversed(words)))
        (root / f"{split}.src").write_text("\n".join(src) + "\n")
        (root / f"{split}.tgt").write_text("\n".join(tgt) + "\n")


def _cli(module: str, *args: str) -> str:
    run = subprocess.run([sys.executable, "-m", f"fairseq_cli.{module}", *args], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if run.returncode != 0:
        raise RuntimeError(f"fairseq_cli.{module} failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return run.stdout + run.stderr


def user_dir() -> str:
    from lion_fairseq.user_dir import path

    return path()


def train_command(data: Path, save: Path, arch: str, extra: List[str], updates: int, seed: int) -> List[str]:
    """The ``fairseq-train`` options every model of ``quality`` gets (only ``--arch`` and ``extra`` differ)."""
    sizes = [x for k, v in TINY.items() for x in (f"--{k.replace('_', '-')}", str(v))] if arch == "transformer" else []
    return [str(data), "--user-dir", user_dir(), "--task", "translation", "--arch", arch, *sizes, *extra,
            "--dropout", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.002",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--max-tokens", "2000", "--max-update", str(updates), "--seed", str(seed),
            "--save-dir", str(save), "--no-epoch-checkpoints", "--no-last-checkpoints", "--cpu", "--num-workers", "0",
            "--log-format", "json", "--log-interval", "50"]


def quality_run(root: Path, data: Path, name: str, arch: str, extra: List[str], updates: int, seed: int) -> Dict:
    save = root / f"{re.sub(r'[^a-z0-9]+', '_', name)}_{seed}"
    start = time.time()
    _cli("train", *train_command(data, save, arch, extra, updates, seed))
    seconds = time.time() - start
    out = _cli("generate", str(data), "--user-dir", user_dir(), "--path",
               str(save / "checkpoint_best.pt"), "--gen-subset", "test", "--beam", "4", "--batch-size", "64", "--required-batch-size-multiple", "1", "--cpu")
    hyps = {m.group(1): m.group(2) for m in re.finditer(r"^H-(\d+)\t\S+\t(.*)$", out, re.M)}
    refs = {m.group(1): m.group(2) for m in re.finditer(r"^T-(\d+)\t(.*)$", out, re.M)}
    exact = sum(hyps[i] == refs[i] for i in refs) / len(refs)
    bleu = float(re.search(r"BLEU4 = ([\d.]+)", out).group(1))
    return {"model": name, "arch": arch, "extra": extra, "seed": seed, "updates": updates, "exact_match": exact,
            "bleu": bleu, "train_s": round(seconds, 1)}


def quality(out: Path, updates: int, seeds: List[int]) -> List[Dict]:
    root = out / "quality"
    write_reversal_corpus(root / "text")
    data = root / "bin"
    if not (data / "dict.src.txt").exists():
        _cli("preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", str(root / "text/train"),
             "--validpref", str(root / "text/valid"), "--testpref", str(root / "text/test"), "--destdir", str(data),
             "--workers", "1")
    jobs = [(name, arch, extra, seed) for seed in seeds for name, arch, extra in QUALITY_MODELS]
    with ThreadPoolExecutor(2) as pool:  # two fairseq-train processes side by side, one thread each
        rows = list(pool.map(lambda j: quality_run(root, data, *j[:3], updates, j[3]), jobs))
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


# ---- decoding speed ------------------------------------------------------------------------------------

def build(arch: str, data: Path, extra: List[str]):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import lion_fairseq  # noqa: F401  (registers the lion archs)

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--task", "translation", "--arch", arch, "--source-lang", "src", "--target-lang", "tgt",
        "--max-source-positions", "8192", "--max-target-positions", "1100", *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model).eval()


def state_mib(state: Dict) -> float:
    return sum(t.numel() * t.element_size() for d in state.values() for t in d.values()
               if torch.is_tensor(t)) / 2 ** 20


def time_decoding(model, S: int, T: int, vocab: int) -> Dict[str, float]:
    """Median seconds of a step near target positions 16, 256 and T, and the state's MiB after T tokens."""
    torch.manual_seed(0)
    src = torch.randint(4, vocab, (1, S))
    with torch.no_grad():
        model.encoder(src[:, :16], torch.tensor([16]))  # first-call costs are not the encoder's speed
        start = time.perf_counter()
        enc = model.encoder(src, torch.tensor([S]))
        out = {"encode_s": time.perf_counter() - start}
        prev = torch.full((1, 1), 2)  # eos starts the target
        state: Dict = {}
        times = []
        for _ in range(T):
            start = time.perf_counter()
            model.decoder(prev, encoder_out=enc, incremental_state=state)
            times.append(time.perf_counter() - start)
            prev = torch.cat([prev, torch.randint(4, vocab, (1, 1))], 1)
    out["ms_at"] = {at: 1000 * statistics.median(times[at - 8:at]) for at in sorted({16, 256, T}) if 8 <= at <= T}
    out["state_mib"] = state_mib(state)
    return out


def _decode_one(name: str, arch: str, extra: List[str], S: int, T: int, vocab: int) -> Dict:
    """One model at one source length in a fresh process, so that its peak RSS is its own."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("src", "tgt"):
            (Path(tmp) / f"dict.{side}.txt").write_text("".join(f"w{i} {vocab - i}\n" for i in range(vocab - 4)))
        model = build(arch, Path(tmp), extra)
    row = {"model": name, "S": S, "T": T, **time_decoding(model, S, T, vocab)}
    row["peak_rss_mib"] = maxrss_mib()
    return row


def decode(sources: List[int], T: int, vocab: int) -> List[Dict]:
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for S in sources:
        for name, arch, extra in DECODE_MODELS:
            with ctx.Pool(1) as pool:
                row = pool.apply(_decode_one, (name, arch, extra, S, T, vocab))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def quality_table(rows: List[Dict]) -> str:
    by_model: Dict[str, List[Dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    lines = ["| model | exact match (mean, min-max over seeds) | BLEU | seeds | train s |", "|---|---:|---:|---:|---:|"]

    def spread(xs: List[float], digits: int) -> str:
        return f"{statistics.mean(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"

    for name, rs in by_model.items():
        lines.append(f"| {name} | {spread([r['exact_match'] for r in rs], 2)} | {spread([r['bleu'] for r in rs], 1)} | "
                     f"{len(rs)} | {statistics.mean(r['train_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def decode_table(rows: List[Dict]) -> str:
    T, at = rows[0]["T"], list(rows[0]["ms_at"])
    lines = ["| source tokens | model | encode s | " + " | ".join(f"ms/token at target {t}" for t in at)
             + f" | state MiB after {T} | peak RSS MiB |", "|---:|---|---:|" + "---:|" * len(at) + "---:|---:|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['model']} | {r['encode_s']:.2f} | "
                     + " | ".join(f"{r['ms_at'][t]:.1f}" for t in at)
                     + f" | {r['state_mib']:.2f} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.translation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["quality", "decode"])
    parser.add_argument("--out", type=out_folder, default="outputs/benchmark/translation")
    parser.add_argument("--updates", type=int, default=600, help="quality: updates per model")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="quality: seeds")
    parser.add_argument("--sources", type=int, nargs="+", default=[64, 512, 2048, 8192], help="decode: source lengths")
    parser.add_argument("--target", type=int, default=1024, help="decode: target tokens decoded")
    parser.add_argument("--vocab", type=int, default=8000, help="decode: source and target vocabulary")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "quality":
        rows = quality(out, args.updates, args.seeds)
        text = (f"Reversal task (target = source reversed through a permutation), tiny models, {args.updates} "
                f"updates, beam 4 on the test split:\n\n" + quality_table(rows))
    else:
        rows = decode(args.sources, args.target, args.vocab)
        text = ("Decoding one target token, base size, batch 1, float32, 1 thread:\n\n" + decode_table(rows))
    (out / f"{args.what}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{args.what}.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
