"""The training part of the GPU run (``python -m lion_fairseq.benchmark.gpu``): a short real ``fairseq-train``
of each LION LM variant in each mixed precision a cluster uses, then the trained checkpoint evaluated in
every form.

- ``fp16``: ``fairseq-train --fp16`` (a half-precision model, fp32 master weights, dynamic loss scaling);
- ``amp``: ``fairseq-train --amp`` (an fp32 model, the forward under CUDA autocast);
- ``bf16``: ``fairseq-hydra-train`` with ``common.bf16: true`` (``fairseq-train --bf16`` takes a TPU path);
- ``fp32``: plain ``fairseq-train`` (what the CPU test of this module runs).

The data is the pydoc corpus the demo uses, word-level, binarised with ``fairseq-preprocess``. The
checkpoint is then loaded in float32 and the loss of one ``--length``-token block of the valid split is
computed in each form (``parallel``, ``chunk`` on fla and in PyTorch, ``recurrent``): the forms must agree."""
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from ..user_dir import path as user_dir

PRECISIONS = ("fp16", "amp", "bf16")
FORMS = ("parallel", "chunk", "chunk-torch", "recurrent")


def prepare_data(root: Path) -> Path:
    """The pydoc corpus as word-level fairseq binaries (train/valid) under ``root``; returns the data folder."""
    from ..demo.corpus import pydoc_paragraphs

    data = root / "data-bin"
    if (data / "dict.txt").exists():
        return data
    lines = [line for line in pydoc_paragraphs() if line]
    root.mkdir(parents=True, exist_ok=True)
    n = len(lines) * 19 // 20
    (root / "train.txt").write_text("\n".join(lines[:n]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[n:]) + "\n")
    subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--only-source", "--trainpref",
                    str(root / "train.txt"), "--validpref", str(root / "valid.txt"), "--destdir", str(data),
                    "--nwordssrc", "16000", "--workers", "4"], check=True, capture_output=True)
    return data


def train_command(data: Path, save: Path, arch: str, precision: str, length: int, updates: int) -> List[str]:
    """The command line of one run (for bf16, writes the hydra config it names into ``save``)."""
    common = dict(arch=arch, length=length, updates=updates, save=save, data=data)
    if precision == "bf16":
        save.mkdir(parents=True, exist_ok=True)
        (save / "bf16.yaml").write_text(HYDRA_BF16.format(user_dir=user_dir(), **common))
        return [sys.executable, "-m", "fairseq_cli.hydra_train", "--config-dir", str(save), "--config-name", "bf16",
                f"hydra.run.dir={save / 'hydra'}"]
    flags = {"fp16": ["--fp16"], "amp": ["--amp"], "fp32": ["--cpu"] if not torch.cuda.is_available() else []}
    return [sys.executable, "-m", "fairseq_cli.train", str(data), "--user-dir", user_dir(), "--task",
            "language_modeling", "--arch", arch, "--tokens-per-sample", str(length), "--batch-size", "2",
            "--max-update", str(updates), "--optimizer", "adam", "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", str(max(1, updates // 4)), "--criterion", "cross_entropy", "--log-format", "json",
            "--log-interval", "1", "--disable-validation", "--no-epoch-checkpoints", "--num-workers", "0",
            "--save-dir", str(save), "--seed", "1", *flags[precision]]


HYDRA_BF16 = """# @package _group_
common: {{user_dir: {user_dir}, bf16: true, seed: 1, log_format: json, log_interval: 1}}
task: {{_name: language_modeling, data: {data}, tokens_per_sample: {length}}}
model: {{_name: {arch}}}
criterion: {{_name: cross_entropy}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: inverse_sqrt, warmup_updates: 5}}
optimization: {{lr: [0.0005], max_update: {updates}}}
dataset: {{batch_size: 2, num_workers: 0, disable_validation: true}}
checkpoint: {{save_dir: {save}, no_epoch_checkpoints: true}}
"""


def losses(log: str) -> List[float]:
    """The per-update losses of fairseq-train's (``| train_inner | {...}``) or fairseq-hydra-train's
    (``[train_inner][INFO] - {...}``) json log."""
    return [float(json.loads(m.group(1))["loss"])
            for m in re.finditer(r"train_inner(?: \| |\]\[INFO\] - )(\{.*\})", log)]


def form_losses(checkpoint: Path, data: Path, length: int, device: str) -> Dict[str, float]:
    """The checkpoint's loss (nats per token) on the first ``length``-token block of the valid split, in
    float32, in each form of ``FORMS`` (``chunk-torch``: the chunk form with fla off)."""
    import lion_fairseq  # noqa: F401  (registers the models, as --user-dir does)
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data), "tokens_per_sample": length})
    model = models[0].float().to(device).eval()
    task.load_dataset("valid")
    item = task.dataset("valid")[0]
    source, target = item["source"][None].to(device), item["target"][None].to(device)
    out = {}
    fla = os.environ.get("LION_FLA", "1")
    for form in FORMS:
        os.environ["LION_FLA"] = "0" if form == "chunk-torch" else fla
        for m in model.modules():
            if hasattr(m, "form") and hasattr(m, "chunk_size"):
                m.form = form.split("-")[0]
        with torch.no_grad():
            logits = model(source)[0].float()
        out[form] = float(torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1)))
    os.environ["LION_FLA"] = fla
    return out


def train_and_evaluate(root: Path, variant: str, precision: str, *, arch_suffix: str = "", length: int = 4096,
                       updates: int = 20, device: str = "cuda") -> Dict:
    """One run: ``{"variant", "precision", "losses", "finite", "seconds", "forms", "forms_agree", "ok"}``
    (or ``"error"``). The forms agree when every form's loss is within 1e-3 (relative) of the parallel
    form's (TF32 on fla's chunk form, float32 elsewhere)."""
    data = prepare_data(root)
    save = root / f"{variant}-{precision}"
    row = {"variant": variant, "precision": precision}
    start = time.time()
    run = subprocess.run(train_command(data, save, f"lion_{variant}_lm{arch_suffix}", precision, length, updates),
                         capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    row["seconds"] = round(time.time() - start, 1)
    log = run.stdout + run.stderr
    (root / f"{variant}-{precision}.log").write_text(log)
    row["losses"] = losses(log)
    row["finite"] = bool(row["losses"]) and all(math.isfinite(x) for x in row["losses"])
    if run.returncode != 0 or not (save / "checkpoint_last.pt").exists():
        row.update(ok=False, error=f"exit {run.returncode}: " + log[-400:])
        return row
    row["forms"] = form_losses(save / "checkpoint_last.pt", data, length, device)
    ref = row["forms"]["parallel"]
    row["forms_agree"] = all(abs(x - ref) <= 1e-3 * abs(ref) for x in row["forms"].values())
    row["ok"] = row["finite"] and len(row["losses"]) == updates and row["forms_agree"]
    return row
