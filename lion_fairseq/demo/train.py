"""The two ``fairseq-train`` commands of the demo (tiny LION-S masked LM and causal LM) and the progress
lines printed while they run."""
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

from lion_fairseq.demo.commands import console

TOKENS_PER_SAMPLE = 128
# what is evaluated and used: the checkpoint with the lowest validation loss (a small corpus is learnt by
# heart after a few dozen epochs, and the validation loss then rises)
CHECKPOINT = "checkpoint_best.pt"
PATIENCE = 5  # stop after this many validations (one per epoch) without a new best


@dataclass
class Model:
    """One of the demo's two models: what it is called and where its files go."""

    name: str  # "mlm" or "lm"
    title: str
    arch: str
    task: str
    criterion: str
    lr: float


# learning rates for a few hundred updates of a tiny model (tried on this corpus: 4e-3 reaches a lower
# validation loss after 200 updates than 1e-3 or 2e-3 for both models)
MLM = Model("mlm", "masked LM", "lion_s_tiny", "masked_lm", "masked_lm", lr=4e-3)
LM = Model("lm", "causal LM", "lion_s_lm_tiny", "language_modeling", "cross_entropy", lr=4e-3)


def train_command(model: Model, data: Path, user_dir: str, save_dir: Path, tensorboard: Path,
                  minutes: float, max_update: int, batch_size: int, seed: int) -> List[str]:
    """``fairseq-train`` for ``model``: Adam with warm-up then inverse-sqrt decay (no schedule length to
    guess under a time budget), stopped after ``minutes`` of training (``--stop-time-hours``),
    ``max_update`` updates (0: no cap) or ``PATIENCE`` epochs without progress, validated each epoch
    and at the end."""
    argv = console("fairseq-train") + [
        str(data), "--user-dir", user_dir,
        "--task", model.task, "--criterion", model.criterion, "--arch", model.arch,
        "--tokens-per-sample", str(TOKENS_PER_SAMPLE), "--sample-break-mode", "none",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-6", "--weight-decay", "0.01",
        "--clip-norm", "1.0", "--lr", str(model.lr), "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "40", "--warmup-init-lr", "1e-7",
        # fairseq drops a last batch whose size is not a multiple of this (8 by default), which can
        # empty a small valid split (fairseq issue #5036)
        "--batch-size", str(batch_size), "--required-batch-size-multiple", "1", "--dropout", "0.1", "--seed", str(seed), "--num-workers", "0",
        "--stop-time-hours", f"{minutes / 60:.6g}",
        "--patience", str(PATIENCE), "--save-dir", str(save_dir), "--no-epoch-checkpoints",
        "--tensorboard-logdir", str(tensorboard), "--log-format", "json", "--log-interval", "10",
    ]
    if model.name == "mlm":
        argv += ["--mask-prob", "0.3"]  # the paper's BERT setting; twice the signal per update of BERT's 0.15
    else:
        argv += ["--share-decoder-input-output-embed"]
    if max_update > 0:
        argv += ["--max-update", str(max_update)]
    return argv


def json_record(line: str, tag: str) -> Optional[dict]:
    """The JSON dict of a fairseq ``--log-format json`` line of ``tag`` (``train_inner``, ``valid``)."""
    if f"| {tag} |" not in line or "{" not in line:
        return None
    try:
        return json.loads(line[line.index("{"):])
    except ValueError:
        return None


class Progress:
    """Prints a training's progress from fairseq's log lines: at most one line per ``every`` seconds,
    with the latest training and validation loss, and why training stopped."""

    def __init__(self, label: str, minutes: float, every: float = 15.0, echo: Callable[[str], None] = print):
        self.label, self.minutes, self.every, self.echo = label, minutes, every, echo
        self.start = time.time()
        self.last = 0.0
        self.updates = 0
        self.train_loss: Optional[float] = None
        self.valid_loss: Optional[float] = None
        self.best: Optional[float] = None

    def __call__(self, line: str) -> None:
        rec = json_record(line, "train_inner")
        if rec is not None:
            self.updates = max(self.updates, int(float(rec.get("num_updates", 0))))
            self.train_loss = float(rec["loss"])
            self._maybe_print()
            return
        rec = json_record(line, "valid")
        if rec is not None and "valid_loss" in rec:
            self.updates = max(self.updates, int(float(rec.get("valid_num_updates", 0))))
            self.valid_loss = float(rec["valid_loss"])
            self.best = self.valid_loss if self.best is None else min(self.best, self.valid_loss)
            self._maybe_print()
            return
        rec = json_record(line, "train")  # end of an epoch (and of training): its update count
        if rec is not None and "train_num_updates" in rec:
            self.updates = max(self.updates, int(float(rec["train_num_updates"])))
            return
        if "Stopping training due to cumulative_training_time" in line:
            self._print(f"time budget of {self.minutes:g} min reached")
        elif "early stop since valid performance hasn't improved" in line:
            self._print(f"stopped early: no better validation loss in the last {PATIENCE} epochs")

    def summary(self) -> str:
        """The last progress line's content, e.g. for the line after training."""
        parts = [f"update {self.updates:>5}"]
        if self.train_loss is not None:
            parts.append(f"train loss {self.train_loss:6.3f}")
        if self.valid_loss is not None:
            parts.append(f"valid loss {self.valid_loss:6.3f} (best {self.best:6.3f})")
        return "  ".join(parts)

    def _maybe_print(self) -> None:
        if time.time() - self.last >= self.every:
            self._print(self.summary())

    def _print(self, text: str) -> None:
        self.last = time.time()
        s = int(self.last - self.start)
        self.echo(f"    [{self.label}] {text}  ({s // 60}m{s % 60:02d}s; budget {self.minutes:g}m of training)")
