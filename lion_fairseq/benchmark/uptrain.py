"""Starting LION from a trained softmax model, measured at CPU scale (issue 27):

    python -m lion_fairseq.benchmark.uptrain               # masked LM, 3 seeds: about 25 minutes on 2 cores

Per seed, on the demo's corpus at ``benchmark.quality``'s size (2 layers x 128, 2 heads, FFN 512, 16 x 128
tokens a batch, Adam at lr 1e-3, inverse_sqrt with 60 warm-up updates, dropout 0.1), all through
``fairseq-train`` as a user runs it:

- **teacher**: ``roberta`` trained ``--updates`` (N) updates;
- **converted, step 0**: the teacher's weights in ``lion_{lit,d,s}_tiny`` (``python -m lion_fairseq.convert``),
  before any update;
- **uptrained**: each of those trained U = N/10 updates (``--finetune-from-model`` the teacher);
- **transfer alone**: ``lion_s_tiny`` after U/2 updates of ``--criterion lion_attention_transfer`` (only the
  attention's q, k and gates move; everything else is the teacher's);
- **transfer, then uptrained**: that, then U/2 ordinary updates (U in all);
- **scratch**: ``lion_s_tiny`` from its own initialisation, U updates and N updates.

Every loss is the masked-LM loss in bits of ``fairseq-validate`` on the valid split, the same masks for
every model of a seed; learning curves come from ``fairseq-train``'s validations. Writes ``uptrain.md``,
``uptrain.json`` and ``uptrain.png`` into ``--out``."""
import argparse
import json
import os
import re
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from ..demo.commands import console, python_module, run, shown
from ..user_dir import path as user_dir_path
from .plotting import pyplot
from .quality import TINY_ENC, TOKENS, curves, mean_curve, prepare_text, spread, train_command

ROWS = ["teacher", "lion_lit converted, step 0", "lion_d converted, step 0", "lion_s converted, step 0",
        "lion_lit uptrained", "lion_d uptrained", "lion_s uptrained", "lion_s transfer alone",
        "lion_s transfer, then uptrained", "lion_s scratch, U updates", "lion_s scratch, N updates"]


def train(root: Path, data: Path, tag: str, flags: List[str], updates: int, seed: int, validate_every: int,
          warmup: int = 60) -> Dict:
    """One ``fairseq-train`` run that keeps its last checkpoint: ``{"checkpoint", "curve", "seconds",
    "command"}``."""
    save = root / "checkpoints" / tag
    # benchmark.quality's masked-LM run; ``flags`` last, so that they win (the transfer's criterion)
    argv = train_command("mlm", data, save, [], updates, seed, TOKENS, 1e-3, warmup, keep=True) + [
        "--validate-interval-updates", str(validate_every), "--save-interval-updates", str(10 ** 9), *flags]
    log, seconds = run(argv, root / "logs" / f"{tag}.log", what=f"training {tag}")
    return {"checkpoint": save / "checkpoint_last.pt", "curve": curves(log)["valid"], "seconds": round(seconds, 1),
            "command": shown(argv)}


def validate(root: Path, data: Path, checkpoint: Path, tag: str, seed: int) -> float:
    """The checkpoint's masked-LM loss (bits) on the valid split through ``fairseq-validate``."""
    argv = console("fairseq-validate") + [
        str(data), "--user-dir", user_dir_path(), "--path", str(checkpoint), "--task", "masked_lm",
        "--valid-subset", "valid", "--batch-size", "16", "--required-batch-size-multiple", "1",
        "--num-workers", "0", "--cpu", "--seed", str(seed), "--log-format", "json"]
    out, _ = run(argv, root / "logs" / f"{tag}_validate.log", what=f"validating {tag}")
    m = re.search(r"\"valid_loss\": \"([0-9.]+)\"", out) or re.search(r"\| loss ([0-9.]+)", out)
    if m is None:
        raise RuntimeError(f"fairseq-validate printed no loss for {tag}:\n{out[-2000:]}")
    return float(m.group(1))


def masked_lm_criterion(checkpoint: Path) -> Path:
    """A copy of an attention-transfer checkpoint whose config names the masked-LM criterion, since
    ``fairseq-validate`` scores with the criterion a checkpoint was trained with."""
    import torch

    from ..clear_errors import _safe_load

    state = _safe_load(str(checkpoint))
    state["cfg"]["criterion"] = {"_name": "masked_lm", "tpu": False}
    out = checkpoint.with_name("checkpoint_masked_lm.pt")
    torch.save(state, out)
    return out


def one_seed(root: Path, data: Path, seed: int, N: int) -> List[Dict]:
    U = max(2, N // 10)
    every = max(1, U // 5)
    rows: List[Dict] = []

    def row(name: str, checkpoint: Path, updates: int, run_: Optional[Dict] = None) -> None:
        rows.append({"model": name, "seed": seed, "updates": updates,
                     "loss": validate(root, data, checkpoint, f"{re.sub(r'[^a-z0-9]+', '_', name.lower())}_{seed}", seed),
                     "curve": run_["curve"] if run_ else [], "command": run_["command"] if run_ else None})

    teacher = train(root, data, f"teacher_{seed}", ["--arch", "roberta", *TINY_ENC], N, seed, max(1, N // 10))
    row("teacher", teacher["checkpoint"], N, teacher)
    start = ["--finetune-from-model", str(teacher["checkpoint"])]
    for v in ("lit", "d", "s"):
        converted = root / "checkpoints" / f"{v}_converted_{seed}.pt"
        run(python_module("lion_fairseq.convert") + [str(teacher["checkpoint"]), str(converted), "--arch",
                                                      f"lion_{v}_tiny", "--data", str(data)],
            root / "logs" / f"{v}_convert_{seed}.log", what=f"converting to lion_{v}")
        row(f"lion_{v} converted, step 0", converted, 0)
        up = train(root, data, f"{v}_uptrained_{seed}", ["--arch", f"lion_{v}_tiny", *start], U, seed, every,
                   warmup=max(1, U // 10))
        row(f"lion_{v} uptrained", up["checkpoint"], U, up)
    transfer = train(root, data, f"s_transfer_{seed}", ["--arch", "lion_s_tiny", *start, "--criterion",
                     "lion_attention_transfer", "--teacher", str(teacher["checkpoint"])], U // 2, seed, U, warmup=1)
    row("lion_s transfer alone", masked_lm_criterion(transfer["checkpoint"]), U // 2, dict(transfer, curve=[]))
    after = train(root, data, f"s_transfer_up_{seed}", ["--arch", "lion_s_tiny", "--finetune-from-model",
                  str(transfer["checkpoint"])], U - U // 2, seed, every, warmup=max(1, U // 10))
    # its curve counts from the start of the transfer
    row("lion_s transfer, then uptrained", after["checkpoint"], U,
        dict(after, curve=[(u + U // 2, v) for u, v in after["curve"]]))
    for n, name in ((U, "lion_s scratch, U updates"), (N, "lion_s scratch, N updates")):
        scratch = train(root, data, f"s_scratch_{n}_{seed}", ["--arch", "lion_s_tiny"], n, seed, every if n == U
                        else max(1, N // 10))
        row(name, scratch["checkpoint"], n, scratch)
    return rows


def table(rows: List[Dict]) -> str:
    by: Dict[str, List[Dict]] = {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    teacher = statistics.mean(r["loss"] for r in by["teacher"])
    lines = ["| model | updates | valid loss, bits (mean ± sd (min-max)) | vs teacher | seeds |",
             "|---|---:|---:|---:|---:|"]
    for name in [n for n in ROWS if n in by]:
        rs = by[name]
        mean = statistics.mean(r["loss"] for r in rs)
        lines.append(f"| {name} | {rs[0]['updates']} | {spread([r['loss'] for r in rs])} | "
                     f"{100 * (mean / teacher - 1):+.1f}% | {len(rs)} |")
    return "\n".join(lines)


def plot(rows: List[Dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    by: Dict[str, List[Dict]] = {}
    for r in rows:
        if r["curve"] and r["model"] != "teacher" and "N updates" not in r["model"]:
            by.setdefault(r["model"], []).append(r)
    for name, rs in by.items():
        ax.plot(*mean_curve([r["curve"] for r in rs]), marker="o", label=name)
    teacher = statistics.mean(r["loss"] for r in rows if r["model"] == "teacher")
    ax.axhline(teacher, color="k", linestyle="--", label="teacher")
    ax.set_xlabel("update (after the start)")
    ax.set_ylabel("valid loss (bits, mean over seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.uptrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/benchmark/uptrain")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--updates", type=int, default=1500, help="the teacher's updates, N (uptraining: N/10)")
    args = parser.parse_args(argv)
    if args.updates < 20:
        raise ValueError("--updates must be at least 20 (uptraining takes a tenth of it)")
    os.environ["OMP_NUM_THREADS"] = "1"  # each fairseq command on one thread, two seeds at a time
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = prepare_text(out)
    with ThreadPoolExecutor(2) as pool:
        rows = [r for rs in pool.map(lambda s: one_seed(out / f"seed{s}", data, s, args.updates), args.seeds)
                for r in rs]
    (out / "uptrain.json").write_text(json.dumps(rows, indent=1, default=str))
    U = max(2, args.updates // 10)
    text = [f"### Starting LION from a RoBERTa teacher: N = {args.updates} teacher updates, U = {U}; seeds "
            f"{args.seeds}", "", table(rows)]
    if plot(rows, out / "uptrain.png"):
        text += ["", f"Learning curves: {out / 'uptrain.png'}"]
    text += ["", f"Commands (seed {args.seeds[0]}):", "", "```"]
    text += [r["command"] for r in rows if r["seed"] == args.seeds[0] and r["command"]] + ["```"]
    (out / "uptrain.md").write_text("\n".join(text) + "\n")
    print("\n" + "\n".join(text), flush=True)


if __name__ == "__main__":
    main()
