"""Loss curves from the tensorboard event files that ``fairseq-train --tensorboard-logdir`` writes
(``<logdir>/train_inner`` every ``--log-interval`` updates, ``<logdir>/valid`` at each validation), with
fairseq's JSON log as the fallback when the ``tensorboard`` package is missing."""
import math
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from lion_fairseq.demo.train import json_record

Curve = List[Tuple[int, float]]


def read_tensorboard(logdir: Path) -> Dict[str, Curve]:
    """``{"train": [(update, loss)], "valid": [...]}`` from one run's tensorboard folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves: Dict[str, Curve] = {}
    for name, sub in (("train", "train_inner"), ("valid", "valid")):
        folder = logdir / sub
        if not folder.is_dir():
            continue
        acc = EventAccumulator(str(folder))
        acc.Reload()
        if "loss" in acc.Tags().get("scalars", []):
            curves[name] = sorted((e.step, e.value) for e in acc.Scalars("loss"))
    return curves


def read_log(log: Path) -> Dict[str, Curve]:
    """The same curves from fairseq's ``--log-format json`` output."""
    curves: Dict[str, Curve] = {"train": [], "valid": []}
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        rec = json_record(line, "train_inner")
        if rec is not None:
            curves["train"].append((int(float(rec["num_updates"])), float(rec["loss"])))
        rec = json_record(line, "valid")
        if rec is not None:
            curves["valid"].append((int(float(rec["valid_num_updates"])), float(rec["valid_loss"])))
    return curves


def read_curves(logdir: Path, log: Path) -> Tuple[Dict[str, Curve], str]:
    """(curves, where they came from): tensorboard's event files, else the training log."""
    try:
        curves = read_tensorboard(logdir)
        if curves.get("train"):
            return curves, "tensorboard"
    except ImportError:
        pass
    return read_log(log), "fairseq log"


def plot_losses(panels: Sequence[Tuple[str, Dict[str, Curve]]], out: Path, uniform_bits: float) -> Path:
    """One panel per model: training loss (line) and validation loss (dots) in bits per token against
    updates, with the uniform guess ``log2(vocab)`` for scale. Writes ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels):
        if curves.get("train"):
            ax.plot(*zip(*curves["train"]), label="train (every 10 updates)")
        if curves.get("valid"):
            ax.plot(*zip(*curves["valid"]), "o-", label="valid")
        if math.isfinite(uniform_bits):
            ax.axhline(uniform_bits, color="grey", ls=":", label=f"uniform guess ({uniform_bits:.1f})")
        ax.set_title(title)
        ax.set_xlabel("update")
        ax.set_ylabel("loss (bits per token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
