"""The training part of the GPU run (``python -m lion_fairseq.benchmark.gpu``): a short real ``fairseq-train``
of each LION LM variant in each mixed precision a cluster uses, then the trained checkpoint evaluated in
every form.

- ``fp16``: ``fairseq-train --fp16`` (a half-precision model, fp32 master weights, dynamic loss scaling);
- ``amp``: ``fairseq-train --amp`` (an fp32 model, the forward under CUDA autocast);
- ``bf16``: ``fairseq-hydra-train`` with ``common.bf16: true`` (``fairseq-train --bf16`` takes a TPU path);
- ``fp32``: plain ``fairseq-train`` (what the CPU test of this module runs).

The data is the pydoc corpus the demo uses, word-level, binarised with ``fairseq-preprocess``. The
checkpoint is then loaded in float32 and the loss of one ``--length``-token block of the valid split is
computed in each form (``parallel``, ``chunk`` on each backend, ``recurrent``): the forms must agree.

``train_speed`` is the end-to-end speed run: ``fairseq-hydra-train`` in bf16 of a softmax model or its LION
counterpart, fairseq's own tokens per second (``wps``). ``eval_lm_forms`` runs ``fairseq-eval-lm`` on one
checkpoint in every form and backend, ``recurrent_decoding`` decodes greedily through the hub's generator
(recurrent steps from the LION state) and checks each token against the parallel form's argmax."""
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch

from ..user_dir import path as user_dir

PRECISIONS = ("fp16", "amp", "bf16")
# form, or form-backend for the chunk form
FORMS = ("parallel", "chunk-triton", "chunk-fla", "chunk-torch", "recurrent")


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


def log_entries(log: str) -> List[Dict]:
    """The per-update entries of fairseq-train's (``| train_inner | {...}``) or fairseq-hydra-train's
    (``[train_inner][INFO] - {...}``) json log."""
    return [json.loads(m.group(1)) for m in re.finditer(r"train_inner(?: \| |\]\[INFO\] - )(\{.*\})", log)]


def losses(log: str) -> List[float]:
    return [float(e["loss"]) for e in log_entries(log)]


@contextmanager
def lion_backend(name: str) -> Iterator[None]:
    """Inside the block, ``LION_BACKEND`` is ``name``; afterwards what it was (or unset)."""
    before = os.environ.get("LION_BACKEND")
    os.environ["LION_BACKEND"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LION_BACKEND")
        else:
            os.environ["LION_BACKEND"] = before


def set_form(model: torch.nn.Module, form: str) -> None:
    """Every LION attention of ``model`` computes in ``form`` from now on."""
    from lion_fairseq.modules import LionAttention

    for m in model.modules():
        if isinstance(m, LionAttention):
            m.form = form


def form_losses(checkpoint: Path, data: Path, length: int, device: str) -> Dict[str, float]:
    """The checkpoint's loss (nats per token) on the first ``length``-token block of the valid split, in
    float32, in each form of ``FORMS`` (``chunk-<backend>``: the chunk form on that backend)."""
    import lion_fairseq  # noqa: F401  (registers the models, as --user-dir does)
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data), "tokens_per_sample": length})
    model = models[0].float().to(device).eval()
    task.load_dataset("valid")
    item = task.dataset("valid")[0]
    source, target = item["source"][None].to(device), item["target"][None].to(device)
    out = {}
    default = os.environ.get("LION_BACKEND") or "torch"
    for form in FORMS:
        with lion_backend(form.split("-")[1] if "-" in form else default), torch.no_grad():
            set_form(model, form.split("-")[0])
            logits = model(source)[0].float()
        out[form] = float(torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1)))
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


HYDRA_SPEED = """# @package _group_
common: {{user_dir: {user_dir}, {precision}, seed: 1, log_format: json, log_interval: 1}}
task: {{_name: {task}, data: {data}, tokens_per_sample: {length}, sample_break_mode: none}}
model: {{_name: {arch}{model}}}
criterion: {{_name: {criterion}}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: inverse_sqrt, warmup_updates: 5}}
optimization: {{lr: [0.0005], max_update: {updates}}}
dataset: {{batch_size: {batch}, num_workers: 0, disable_validation: true, required_batch_size_multiple: 1}}
checkpoint: {{save_dir: {save}, {save_flags}}}
"""
TASKS = {"lm": ("language_modeling", "cross_entropy"), "mlm": ("masked_lm", "masked_lm")}


def train_speed(root: Path, task: str, arch: str, length: int, backend: Optional[str], *, tokens: int = 16384,
                updates: int = 15, keep_checkpoint: bool = False, device: str = "cuda",
                model: Optional[Dict] = None) -> Dict:
    """One ``fairseq-hydra-train`` run for speed: ``task`` ``"lm"`` or ``"mlm"``, batches of ``tokens // length``
    samples of ``length`` contiguous tokens, bf16 on a GPU (float32 with ``device="cpu"``), LION's chunk form
    on ``backend`` (``LION_BACKEND``; None for a softmax model). Returns ``{"task", "arch", "backend", "L",
    "B", "wps", "losses", "seconds"}``, fairseq's ``wps`` as the median after the first three updates
    (Triton's compiling and cuDNN's autotuning land there), ``"checkpoint"`` when kept, or ``"error"``.
    ``model``: more fields of the model's config (sizes, for a CPU test)."""
    data = prepare_data(root)
    name = f"{task}-{arch}-{backend or 'softmax'}-{length}"
    save = root / name
    save.mkdir(parents=True, exist_ok=True)
    batch = max(1, tokens // length)
    fields = dict(model or {})
    if task == "mlm":  # learned positions (RoBERTa) must cover the samples; LION-S has none
        fields.setdefault("max_positions", length)
    save_flags = "no_epoch_checkpoints: true" if keep_checkpoint else "no_save: true"
    config = HYDRA_SPEED.format(
        user_dir=user_dir(), precision="bf16: true" if device == "cuda" else "cpu: true", task=TASKS[task][0],
        data=data, length=length, arch=arch, model="".join(f", {k}: {v}" for k, v in fields.items()),
        criterion=TASKS[task][1], updates=updates, batch=batch, save=save, save_flags=save_flags)
    (save / "speed.yaml").write_text(config)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LION_BACKEND", None)
    if backend is not None:
        env["LION_BACKEND"] = backend
    row = {"task": task, "arch": arch, "backend": backend, "L": length, "B": batch}
    start = time.time()
    run = subprocess.run([sys.executable, "-m", "fairseq_cli.hydra_train", "--config-dir", str(save),
                          "--config-name", "speed", f"hydra.run.dir={save / 'hydra'}"],
                         capture_output=True, text=True, env=env)
    row["seconds"] = round(time.time() - start, 1)
    log = run.stdout + run.stderr
    (save / "train.log").write_text(log)
    entries = log_entries(log)
    row["losses"] = [float(e["loss"]) for e in entries]
    wps = [float(e["wps"]) for e in entries[3:]]
    row["wps"] = statistics.median(wps) if wps else None
    if run.returncode != 0 or not wps or not all(math.isfinite(x) for x in row["losses"]):
        row["error"] = f"exit {run.returncode}: " + log[-400:]
    elif keep_checkpoint:
        row["checkpoint"] = str(save / "checkpoint_last.pt")
    return row


def eval_lm_forms(checkpoint: Path, length: int, device: str = "cuda",
                  forms: tuple = FORMS) -> Dict:
    """``fairseq-eval-lm`` of a LION LM checkpoint (data: ``prepare_data``'s beside its run folder) in each
    form, switched with ``--model-overrides``, the chunk form on each backend (``LION_BACKEND``):
    ``{form: {"loss", "ppl"} or {"error"}}``, the loss in base 2 as fairseq prints it."""
    data = checkpoint.parent.parent / "data-bin"
    out = {}
    for form in forms:
        name, _, backend = form.partition("-")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["LION_BACKEND"] = backend or "torch"
        argv = [sys.executable, "-m", "fairseq_cli.eval_lm", str(data), "--path", str(checkpoint), "--user-dir",
                user_dir(), "--gen-subset", "valid", "--tokens-per-sample", str(length), "--batch-size", "4",
                "--required-batch-size-multiple", "1", "--num-workers", "0",
                "--model-overrides", repr({"lion_form": name})] + (["--cpu"] if device == "cpu" else [])
        run = subprocess.run(argv, capture_output=True, text=True, env=env)
        found = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", run.stdout + run.stderr)
        out[form] = ({"loss": float(found.group(1)), "ppl": float(found.group(2))} if run.returncode == 0 and found
                     else {"error": f"exit {run.returncode}: " + (run.stdout + run.stderr)[-400:]})
    return out


def recurrent_decoding(checkpoint: Path, device: str = "cuda", prompt_tokens: int = 64, new_tokens: int = 64) -> Dict:
    """Greedy decoding of a LION LM checkpoint through the hub's generator in the recurrent form (the
    LION state ``(S, z)`` per layer, one token per step), timed, then the whole sequence scored once in
    the parallel form: ``agree`` counts the generated tokens that are its argmax at their position."""
    from lion_fairseq.models.lion_lm import LionLanguageModel

    data = checkpoint.parent.parent / "data-bin"
    hub = LionLanguageModel.from_pretrained(str(checkpoint.parent), checkpoint.name, str(data),
                                            lion_form="recurrent").to(device).eval()
    words = (checkpoint.parent.parent / "valid.txt").read_text().split()[:prompt_tokens]
    prompt = hub.encode(" ".join(words))[:-1]  # without the end of sentence
    n = len(prompt)
    with torch.no_grad():
        hub.generate([prompt], beam=1, sampling=False, max_len_b=4, min_len=4)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        hypo = hub.generate([prompt], beam=1, sampling=False, max_len_b=new_tokens, min_len=new_tokens)[0][0]
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = hypo["tokens"]
        generated = tokens[n:n + new_tokens]  # the generator ends on an end of sentence it forces at max_len
        model = hub.models[0]
        set_form(model, "parallel")
        # the generator's first input is the end-of-sentence marker, then the tokens so far
        inputs = torch.cat([tokens.new_tensor([hub.task.dictionary.eos()]), tokens[:-1]])[None].to(device)
        best = model(inputs)[0][0].argmax(-1)[n:n + len(generated)]
    generated = generated.to(best.device)
    return {"prompt_tokens": n, "new_tokens": int(len(generated)), "ms_per_token": seconds * 1e3 / max(1, len(generated)),
            "agree": int((best == generated).sum())}
