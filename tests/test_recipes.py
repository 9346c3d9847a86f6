"""Every recipe of user_dir_examples/ run as a user runs it (the bash scripts, the fairseq-hydra-train
commands of hydra/README.md) at tiny size on a small corpus, so none rots; and the scripts' settings
(learning rates, warm-up, metrics, refusals) checked against a stand-in fairseq-train."""
import json
import math
import os
import random
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, USER_DIR, corpus_lines
import warm_python

RECIPES = ROOT / "user_dir_examples"
TINY_ENCODER = ["model.encoder_layers=2", "model.encoder_embed_dim=128", "model.encoder_ffn_embed_dim=512",
                "model.encoder_attention_heads=2"]
HYDRA_CPU = ["common.fp16=false", "common.cpu=true", "dataset.num_workers=0", "common.log_interval=1"]


def env(**settings: str) -> dict:
    """The environment of a recipe: this interpreter's console scripts first on PATH, one thread per
    process (two cores shared with other tests), and the recipe's settings."""
    e = dict(os.environ, **settings)
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    e.pop("USER_DIR", None)
    return warm_python.on_path(e)


def run(argv, ok=True, stdin=None, **settings) -> str:
    """Run a recipe (``bash script ...`` or a console command) from the checkout root; its stdout+stderr."""
    proc = subprocess.run([str(a) for a in argv], cwd=ROOT, env=env(**settings), input=stdin, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    if ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} failed ({proc.returncode}):\n{proc.stdout[-5000:]}")
    if not ok:
        assert proc.returncode != 0, f"expected a failure:\n{proc.stdout[-2000:]}"
    return proc.stdout


def records(log: str, tag: str):
    """fairseq's JSON log records of one kind, from fairseq-train's or fairseq-hydra-train's format."""
    out = []
    for line in log.splitlines():
        if (f"| {tag} |" in line or f"[{tag}][" in line) and "{" in line:
            out.append(json.loads(line[line.index("{"):]))
    return out


def model_cfg(checkpoint: Path) -> dict:
    """The saved config, loaded the safe way (it must reload under torch's weights_only default)."""
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["cfg"]


@pytest.fixture(scope="module")
def spm_data(tmp_path_factory) -> Path:
    """A small sentencepiece corpus made by the project's own preprocess.text (as the MLM recipe says)."""
    root = tmp_path_factory.mktemp("recipes")
    (root / "corpus.txt").write_text("\n".join(corpus_lines(1500)) + "\n")
    run([sys.executable, "-m", "preprocess.text", "--input", root / "corpus.txt", "--destdir", root / "bin",
         "--vocab-size", "500"])
    return root / "bin"


@pytest.fixture(scope="module")
def mlm(spm_data, tmp_path_factory):
    """(checkpoint, output) of mlm/pretrain.sh at tiny size."""
    save = tmp_path_factory.mktemp("mlm")
    out = run(["bash", RECIPES / "mlm/pretrain.sh", spm_data, save, "--num-workers", "0"],
              ARCH="lion_s_tiny", MAX_UPDATE="6", BATCH_SIZE="8", UPDATE_FREQ="1", LOG_INTERVAL="1")
    return save / "checkpoint_last.pt", out


def test_mlm_pretrain_paper_settings(mlm):
    ckpt, out = mlm
    command = next(line for line in out.splitlines() if line.startswith("+ fairseq-train"))
    assert f"--user-dir {USER_DIR}" in command
    cfg = model_cfg(ckpt)
    assert cfg["model"]["_name"] == "lion_s_tiny" and cfg["model"]["lion_variant"] == "s"
    assert cfg["task"]["mask_prob"] == 0.3 and cfg["task"]["tokens_per_sample"] == 128
    assert cfg["optimizer"]["adam_eps"] == 1e-6 and eval(cfg["optimizer"]["adam_betas"]) == (0.9, 0.98)
    # linear warm-up to 8e-4, then linear decay to 2% of it at the last update
    lrs = [float(r["lr"]) for r in records(out, "train_inner")]
    assert len(lrs) == 6 and max(lrs) == pytest.approx(8e-4) and lrs[-1] == pytest.approx(1.6e-5)
    assert all(a > b for a, b in zip(lrs[lrs.index(max(lrs)):], lrs[lrs.index(max(lrs)) + 1:]))
    assert list((ckpt.parent / "tensorboard" / "train_inner").glob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def glue_data(spm_data, tmp_path_factory) -> Path:
    """A toy RTE-format task (header, sentence pairs, string labels) prepared by glue/prepare.sh."""
    root = tmp_path_factory.mktemp("glue")
    lines = [s for s in corpus_lines(3000) if 6 <= len(s.split()) <= 30]
    rng = random.Random(0)
    (root / "RTE").mkdir()
    for split, n in (("train", 96), ("dev", 32)):
        rows = ["index\tsentence1\tsentence2\tlabel"]
        for i in range(n):
            a = rng.choice(lines)
            entailed = rng.random() < 0.5  # the second sentence is a prefix of the first, or unrelated
            b = " ".join(a.split()[:4]) if entailed else rng.choice(lines)
            rows.append(f"{i}\t{a}\t{b}\t{'entailment' if entailed else 'not_entailment'}")
        (root / "RTE" / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    run(["bash", RECIPES / "glue/prepare.sh", "RTE", root / "RTE", spm_data, root / "RTE-bin"])
    return root / "RTE-bin"


def test_glue_prepare_layouts(glue_data, spm_data, tmp_path):
    manifest = json.loads((glue_data / "preprocess.json").read_text())
    assert manifest["pair"] and manifest["classes"] == ["entailment", "not_entailment"]
    assert (glue_data / "input1" / "train.bin").exists() and (glue_data / "label" / "dict.txt").exists()
    # CoLA: no header, sentence in column 3 and label in column 1 (GLUE's layout)
    (tmp_path / "CoLA").mkdir()
    for split in ("train", "dev"):
        (tmp_path / "CoLA" / f"{split}.tsv").write_text(
            "".join(f"gj04\t{i % 2}\t\t{s}\n" for i, s in enumerate(corpus_lines(40))))
    run(["bash", RECIPES / "glue/prepare.sh", "CoLA", tmp_path / "CoLA", spm_data, tmp_path / "CoLA-bin"])
    cola = json.loads((tmp_path / "CoLA-bin" / "preprocess.json").read_text())
    assert not cola["pair"] and cola["classes"] == ["0", "1"] and cola["rows"]["train"] == 40
    out = run(["bash", RECIPES / "glue/prepare.sh", "BoolQ", tmp_path, spm_data, tmp_path / "x"], ok=False)
    assert "unknown TASK 'BoolQ'" in out
    # an earlier output is replaced; a swapped argument naming the pretraining data or the TSVs' folder as
    # DEST_DIR is refused, and that folder left as it was (it used to be replaced: --force on every run)
    run(["bash", RECIPES / "glue/prepare.sh", "CoLA", tmp_path / "CoLA", spm_data, tmp_path / "CoLA-bin"])
    for dest in (spm_data, tmp_path / "CoLA"):
        before = sorted(p.name for p in dest.iterdir())
        out = run(["bash", RECIPES / "glue/prepare.sh", "CoLA", tmp_path / "CoLA", spm_data, dest], ok=False)
        assert "is not an earlier output of this script" in out and sorted(p.name for p in dest.iterdir()) == before


def test_glue_finetune_from_pretrained(glue_data, mlm, tmp_path):
    ckpt, _ = mlm
    # no ARCH: the recipe reads the arch and sizes the checkpoint was trained as (lion_s_tiny)
    out = run(["bash", RECIPES / "glue/finetune.sh", glue_data, ckpt, tmp_path, "--num-workers", "0"],
              MAX_UPDATE="4", BATCH_SIZE="8", LOG_INTERVAL="1")
    assert f"Loaded checkpoint {ckpt}" in out
    valid = records(out, "valid")
    assert valid and 0.0 <= float(valid[-1]["valid_accuracy"]) <= 100.0
    tuned = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert tuned["cfg"]["task"]["num_classes"] == 2 and tuned["cfg"]["task"]["init_token"] == 0
    assert tuned["model"]["classification_heads.sentence_classification_head.out_proj.weight"].shape[0] == 2
    # the encoder starts from the pretrained weights: 4 updates at lr <= 1e-5 move them by < 1e-3
    pre = torch.load(ckpt, map_location="cpu", weights_only=True)["model"]
    name = "encoder.sentence_encoder.layers.0.fc1.weight"
    assert (tuned["model"][name] - pre[name]).abs().max() < 1e-3
    assert (pre[name]).abs().max() > 1e-2
    # the hub as glue/README.md shows it, with no bpe=: it encodes with the model prepare.sh left in the data
    from lion_fairseq import LionRobertaModel

    hub = LionRobertaModel.from_pretrained(str(tmp_path), "checkpoint_last.pt", str(glue_data))
    tokens = hub.encode("the value of the object", "a list of items")
    assert (tokens == hub.task.source_dictionary.unk()).sum() == 0
    assert hub.predict("sentence_classification_head", tokens).shape == (1, 2)


@pytest.fixture(scope="module")
def wiki_data(tmp_path_factory) -> Path:
    """WikiText-layout files (wiki.{train,valid,test}.tokens) binarised by lm/prepare.sh."""
    root = tmp_path_factory.mktemp("wiki")
    lines = corpus_lines(2000)
    for split, part in (("train", lines[:1800]), ("valid", lines[1800:1900]), ("test", lines[1900:])):
        (root / f"wiki.{split}.tokens").write_text(" = Python = \n\n" + "\n".join(f" {s} " for s in part) + "\n")
    run(["bash", RECIPES / "lm/prepare.sh", root, root / "bin"])
    return root / "bin"


def test_lm_train_eval_generate(wiki_data, tmp_path):
    out = run(["bash", RECIPES / "lm/train.sh", wiki_data, tmp_path, "--num-workers", "0"],
              ARCH="lion_s_lm_tiny", MAX_UPDATE="5", TOKENS_PER_SAMPLE="64", MAX_TOKENS="512", UPDATE_FREQ="1",
              WARMUP_UPDATES="2", LOG_INTERVAL="1")
    assert len(records(out, "train_inner")) == 5
    ckpt = tmp_path / "checkpoint_last.pt"
    cfg = model_cfg(ckpt)
    assert cfg["model"]["_name"] == "lion_s_lm_tiny" and cfg["model"]["share_decoder_input_output_embed"]

    out = run(["bash", RECIPES / "lm/eval.sh", wiki_data, ckpt, "--num-workers", "0"],
              FORM="recurrent", TOKENS_PER_SAMPLE="64")
    assert "{'lion_form': 'recurrent'}" in out.replace("\\", "") and "--context-window 50 " in out
    loss = float(re.search(r"Loss \(base 2\): ([0-9.]+)", out).group(1))
    vocab = sum(1 for _ in open(wiki_data / "dict.txt")) + 4
    assert 1.0 < loss < math.log2(vocab) + 3  # trained for 5 updates: near, not far above, uniform
    # a context window as long as the blocks leaves nothing to score: refused before fairseq (it crashed
    # there with "negative dimensions are not allowed" or a ZeroDivisionError)
    out = run(["bash", RECIPES / "lm/eval.sh", wiki_data, ckpt], ok=False, TOKENS_PER_SAMPLE="64",
              CONTEXT_WINDOW="64")
    assert "CONTEXT_WINDOW (64) must be a whole number below TOKENS_PER_SAMPLE (64)" in out
    # passed on as options, one met the other's default (fairseq's "negative dimensions are not allowed")
    out = run(["bash", RECIPES / "lm/eval.sh", wiki_data, ckpt, "--tokens-per-sample", "64"], ok=False)
    assert "--tokens-per-sample: set TOKENS_PER_SAMPLE= and CONTEXT_WINDOW= instead" in out
    # a form that is none: named before fairseq, which stopped with a traceback once the model was loaded
    out = run(["bash", RECIPES / "lm/eval.sh", wiki_data, ckpt], ok=False, FORM="rnn")
    assert "error: FORM must be parallel, chunk or recurrent (the --lion-form to run the checkpoint in), got 'rnn'" \
        in out and "Traceback" not in out, out

    # MAX_LEN counts new tokens: a prompt longer than it comes back whole and continued (fairseq's
    # --max-len-b alone would cut it to its first MAX_LEN tokens); --min-len (which counts the prompt) at
    # prompt + MAX_LEN keeps the untrained model from stopping early, so exactly MAX_LEN are generated
    prompt = "the python language is a list of items and the value of the object is the name of the function"
    out = run(["bash", RECIPES / "lm/generate.sh", wiki_data, ckpt, "--min-len", str(len(prompt.split()) + 6)],
              stdin=prompt + "\n", MAX_LEN="6")
    hyps = [line.split("\t")[2] for line in out.splitlines() if line.startswith("H-")]
    assert len(hyps) == 1 and hyps[0].startswith(prompt) and len(hyps[0].split()) == len(prompt.split()) + 6, hyps


def test_translation_prepare_train_generate(tmp_path):
    """The IWSLT'14 recipe on a corpus in prepare-iwslt14.sh's layout (train/valid/test .de/.en) that the
    test writes: the reversal task, tiny LION-S with linear cross-attention, generated in the recurrent form."""
    from lion_fairseq.benchmark.translation import write_reversal_corpus

    text = tmp_path / "iwslt14.tokenized.de-en"
    write_reversal_corpus(text, sizes=(("train", 300), ("valid", 20), ("test", 12)))
    for path in text.iterdir():  # the reversal corpus as German (source) and English (target)
        path.rename(path.with_suffix({".src": ".de", ".tgt": ".en"}[path.suffix]))
    run(["bash", RECIPES / "translation/prepare.sh", text, tmp_path / "bin"], WORKERS="1")
    out = run(["bash", RECIPES / "translation/train.sh", tmp_path / "bin", tmp_path / "ckpt", "--num-workers", "0"],
              ARCH="lion_s_transformer_tiny", CROSS_ATTENTION="linear", MAX_UPDATE="5", MAX_TOKENS="500",
              WARMUP_UPDATES="2", LOG_INTERVAL="1", LION_CHUNK_SIZE="4")
    assert len(records(out, "train_inner")) == 5
    cfg = model_cfg(tmp_path / "ckpt" / "checkpoint_last.pt")["model"]
    assert cfg["_name"] == "lion_s_transformer_tiny" and cfg["lion_cross_attention"] == "linear"
    assert cfg["dropout"] == 0.3  # fairseq's IWSLT recipe's
    out = run(["bash", RECIPES / "translation/generate.sh", tmp_path / "bin", tmp_path / "ckpt" / "checkpoint_last.pt"],
              BEAM="2", LION_FORM="recurrent")
    assert len([line for line in out.splitlines() if line.startswith("H-")]) == 12 and "BLEU4 = " in out
    assert "missing or empty" in run(["bash", RECIPES / "translation/prepare.sh", tmp_path, tmp_path / "x"], ok=False)
    out = run(["bash", RECIPES / "translation/generate.sh", tmp_path / "bin", tmp_path / "ckpt" / "checkpoint_last.pt"],
              ok=False, LION_FORM="rnn")
    assert "error: LION_FORM must be parallel, chunk or recurrent" in out and "Traceback" not in out, out


def hydra(config_dir: str, name: str, *overrides: str, logs: Path = None) -> str:
    """fairseq-hydra-train on a recipe's config; hydra's log folder goes to ``logs``, not into the checkout
    (hydra's default is outputs/<date>/<time> under the folder it runs in)."""
    run_dir = [f"hydra.run.dir={logs}"] if logs else []
    return run(["fairseq-hydra-train", "--config-dir", RECIPES / "hydra" / config_dir, "--config-name", name,
                f"common.user_dir={USER_DIR}", *HYDRA_CPU, *overrides, *run_dir])


def test_hydra_pretrain_then_finetune(spm_data, glue_data, tmp_path):
    out = hydra("pretraining", "base", f"task.data={spm_data}", f"checkpoint.save_dir={tmp_path / 'mlm'}",
                "model.lion_variant=d", *TINY_ENCODER, "optimization.max_update=3", "lr_scheduler.total_num_update=3",
                "lr_scheduler.warmup_updates=1", "dataset.batch_size=8", "optimization.update_freq=[1]",
                logs=tmp_path / "hydra")
    assert len(records(out, "train_inner")) == 3
    cfg = model_cfg(tmp_path / "mlm" / "checkpoint_last.pt")
    assert cfg["model"]["_name"] == "lion_roberta" and cfg["model"]["lion_variant"] == "d"
    assert cfg["model"]["encoder_layers"] == 2 and cfg["task"]["mask_prob"] == 0.3
    assert cfg["optimization"]["lr"] == [0.0008] and cfg["lr_scheduler"]["end_learning_rate"] == 1.6e-5

    finetune = ["finetuning", "glue", f"task.data={glue_data}", "task.num_classes=2",
                f"checkpoint.finetune_from_model={tmp_path / 'mlm' / 'checkpoint_last.pt'}",
                f"checkpoint.save_dir={tmp_path / 'ft'}", "model.lion_variant=d", *TINY_ENCODER,
                "lr_scheduler.warmup_updates=1", "dataset.batch_size=8"]
    out = hydra(*finetune, "optimization.max_update=3", logs=tmp_path / "hydra")
    assert f"Loaded checkpoint {tmp_path / 'mlm' / 'checkpoint_last.pt'}" in out
    assert records(out, "valid") and "valid_accuracy" in records(out, "valid")[-1]
    # run again for longer: it goes on from its own last checkpoint, not from the pretrained weights again
    out = hydra(*finetune, "optimization.max_update=4", logs=tmp_path / "hydra")
    assert f"Loaded checkpoint {tmp_path / 'ft' / 'checkpoint_last.pt'} (epoch 1 @ 3 updates)" in out, out[-3000:]


def test_hydra_glue_metric_overrides_compose_as_documented():
    """Each task's metric overrides, as glue.yaml's header gives them, compose into the config (hydra's
    ``--cfg job``: composed and printed, nothing run). Before, the criterion block lacked the keys and hydra
    refused them ("Key 'report_mcc' is not in struct")."""
    header = "#" + (RECIPES / "hydra" / "finetuning" / "glue.yaml").read_text().split("\n# Metrics:", 1)[1]
    header = " ".join(line.lstrip("# ") for line in header.split("\n") if line.startswith("#"))
    tasks = [[w.rstrip(".") for w in part.split() if "=" in w] for part in header.split(";")]
    assert [len(t) for t in tasks] == [2, 2, 4], tasks  # CoLA; MRPC/QQP; STS-B
    required = ["task.data=x", "task.num_classes=2", "checkpoint.finetune_from_model=x", "optimization.max_update=10",
                "lr_scheduler.warmup_updates=1"]
    for overrides in tasks:
        printed = hydra("finetuning", "glue", *required, *overrides, "--cfg", "job")
        for key, value in (o.split("=") for o in overrides):
            assert re.search(rf"^\s+{key.split('.')[-1]}: {value}$", printed, re.M), (key, printed[-3000:])


def test_hydra_lm(wiki_data, tmp_path):
    # an arch name as _name gives its variant: the config leaves it to the arch (its 's' built LION-S
    # under a name that says D)
    command = ("lm", "wiki103", f"task.data={wiki_data}", f"checkpoint.save_dir={tmp_path}",
               "model._name=lion_d_lm_tiny", "model.decoder_layers=2", "model.decoder_embed_dim=128",
               "model.decoder_ffn_embed_dim=512", "model.decoder_attention_heads=2", "task.tokens_per_sample=64",
               "dataset.max_tokens=512", "optimization.update_freq=[1]", "optimization.max_update=3",
               "lr_scheduler.warmup_updates=1")
    out = hydra(*command, logs=tmp_path / "hydra")
    assert len(records(out, "train_inner")) == 3
    cfg = model_cfg(tmp_path / "checkpoint_last.pt")
    assert cfg["model"]["_name"] == "lion_d_lm_tiny" and cfg["model"]["lion_variant"] == "d"
    assert cfg["model"]["decoder_layers"] == 2
    assert cfg["task"]["tokens_per_sample"] == 64
    # the same command again: the run has finished, so it trains nothing and leaves its checkpoints as they are
    last = (tmp_path / "checkpoint_last.pt").read_bytes()
    out = hydra(*command, logs=tmp_path / "hydra")
    assert "is at 3 updates and --max-update is 3: this run has finished" in out and "Under fairseq-hydra-train" in out
    assert not records(out, "train_inner") and (tmp_path / "checkpoint_last.pt").read_bytes() == last


# ---- the scripts' own logic, against a stand-in fairseq-train that prints its arguments ----------------

@pytest.fixture
def stub_bin(tmp_path) -> Path:
    """A folder with a fake fairseq-train, one argument a line, put first on PATH by ``run_stub``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "fairseq-train"
    fake.write_text("#!/usr/bin/env bash\nprintf 'ARG %s\\n' \"$@\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def run_stub(stub_bin: Path, argv, ok=True, **settings) -> list:
    e = env(**settings)
    e["PATH"] = os.pathsep.join([str(stub_bin), e["PATH"]])
    proc = subprocess.run([str(a) for a in argv], cwd=ROOT, env=e, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=60)
    assert (proc.returncode == 0) == ok, proc.stdout
    return proc.stdout if not ok else [line[4:] for line in proc.stdout.splitlines() if line.startswith("ARG ")]


def option(args: list, name: str) -> str:
    return args[args.index(name) + 1]


def test_pretrain_defaults_base_and_large(stub_bin, spm_data, tmp_path):
    args = run_stub(stub_bin, ["bash", RECIPES / "mlm/pretrain.sh", spm_data, tmp_path], PRECISION="fp32")
    assert option(args, "--lr") == "8e-4" and option(args, "--end-learning-rate") == "1.6e-05"
    assert option(args, "--max-update") == "70000" and option(args, "--warmup-updates") == "4200"
    assert int(option(args, "--batch-size")) * int(option(args, "--update-freq")) == 4096
    assert option(args, "--mask-prob") == "0.3" and "--fp16" not in args
    args = run_stub(stub_bin, ["bash", RECIPES / "mlm/pretrain.sh", spm_data, tmp_path, "--lr", "1e-3"],
                    ARCH="lion_d_large", PRECISION="fp16")
    assert option(args, "--arch") == "lion_d_large" and option(args, "--lr") == "2e-4"
    assert option(args, "--end-learning-rate") == "4e-06" and "--fp16" in args
    assert args[-2:] == ["--lr", "1e-3"]  # extra options come last, so they win
    out = run_stub(stub_bin, ["bash", RECIPES / "mlm/pretrain.sh", spm_data, tmp_path], ok=False, PRECISION="bf16")
    assert "fairseq-train --bf16" in out and "common.bf16=true" in out
    out = run_stub(stub_bin, ["bash", RECIPES / "mlm/pretrain.sh", tmp_path, tmp_path], ok=False)
    assert "has no dict.txt" in out
    # an arch of another kind failed in fairseq-train on an option it does not take (--attention-dropout)
    out = run_stub(stub_bin, ["bash", RECIPES / "mlm/pretrain.sh", spm_data, tmp_path], ok=False,
                   ARCH="lion_s_lm_tiny", PRECISION="fp32")
    assert "ARCH must be a masked-LM encoder" in out and "'lion_s_lm_tiny'" in out


def test_lm_and_translation_warm_up_for_the_same_share_of_a_shorter_run(stub_bin, tmp_path):
    """Upstream's 4000 warm-up updates of 50k (LM) and 60k (translation); a run of MAX_UPDATE=20 warmed up
    for 4000 too and ended at a 200th of the learning rate. It warms up for the same share, at least 1."""
    (tmp_path / "dict.txt").write_text("a 1\n")
    (tmp_path / "dict.de.txt").write_text("a 1\n")
    for recipe, full in (("lm/train.sh", 50000), ("translation/train.sh", 60000)):
        argv = ["bash", RECIPES / recipe, tmp_path, tmp_path / "ckpt"]
        assert option(run_stub(stub_bin, argv, PRECISION="fp32"), "--warmup-updates") == "4000"
        # 0 is fairseq's "no limit" (with --max-epoch, say): the full warm-up; a leading zero is decimal
        for updates, warmup in ((full // 10, "400"), (20, "1"), (10 * full, "4000"), (0, "4000"),
                                ("0" + str(full // 10), "400")):
            args = run_stub(stub_bin, argv, PRECISION="fp32", MAX_UPDATE=str(updates))
            assert option(args, "--warmup-updates") == warmup, (recipe, updates)
        args = run_stub(stub_bin, argv, PRECISION="fp32", MAX_UPDATE="20", WARMUP_UPDATES="7")
        assert option(args, "--warmup-updates") == "7"
        # an arch of another kind, named before fairseq-train fails on an option that arch lacks
        other = {"lm/train.sh": "lion_s_tiny", "translation/train.sh": "lion_s_lm_tiny"}[recipe]
        assert "ARCH must be a" in run_stub(stub_bin, argv, ok=False, PRECISION="fp32", ARCH=other)


def test_precision_defaults_to_fp16_on_a_gpu_host_unless_cpu_is_passed(stub_bin, tmp_path, monkeypatch):
    """Where nvidia-smi sees a GPU the recipes train in fp16, but a --cpu passed on (lra/README.md's CPU
    command) gave fairseq --fp16 --cpu, whose fp16 optimizer needs CUDA."""
    monkeypatch.delenv("PRECISION", raising=False)
    gpu = stub_bin / "nvidia-smi"
    gpu.write_text("#!/usr/bin/env bash\necho 'GPU 0: a stand-in'\n")
    gpu.chmod(gpu.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "dict.txt").write_text("a 1\n")
    argv = ["bash", RECIPES / "lm/train.sh", tmp_path, tmp_path / "ckpt"]
    assert "--fp16" in run_stub(stub_bin, argv)
    args = run_stub(stub_bin, argv + ["--cpu"])
    assert "--fp16" not in args and args[-1] == "--cpu"


def test_lra_recipe_takes_the_recipes_precision_and_refuses_another_kind_of_arch(stub_bin, tmp_path):
    """lra/train.sh sources common.sh like the other recipes: PRECISION=amp gives --amp (it was refused);
    an arch of another kind is named before fairseq fails on an interpolation of its config."""
    shutil.copy(stub_bin / "fairseq-train", stub_bin / "fairseq-validate")
    (tmp_path / "lra.json").write_text("{}")
    argv = ["bash", RECIPES / "lra/train.sh", "listops", tmp_path, tmp_path / "ckpt"]
    args = run_stub(stub_bin, argv, PRECISION="amp")
    assert "--amp" in args and option(args, "--arch") == "lion_s_lra_listops"
    assert option(args, "--warmup-updates") == "1000" and option(args, "--max-update") == "5000"
    out = run_stub(stub_bin, argv, ok=False, ARCH="lion_s_transformer_tiny", PRECISION="fp32")
    assert "ARCH must be an LRA classifier (lion_{lit,d,s}_lra_{listops,small,tiny})" in out
    # a shorter run warms up for the same share (it stayed in a warm-up of 1000); bad settings are named
    args = run_stub(stub_bin, argv, PRECISION="fp32", MAX_UPDATE="500")
    assert option(args, "--warmup-updates") == "100" and option(args, "--max-update") == "500"
    # the cosine tasks fix their period (--max-update passed on stops the schedule, as for the others), and
    # refuse a run with no update after the warm-up, where fairseq divided by zero
    image = ["bash", RECIPES / "lra/train.sh", "image", tmp_path, tmp_path / "ckpt"]
    args = run_stub(stub_bin, image, PRECISION="fp32")
    assert option(args, "--lr-period-updates") == str(35000 - 175) and option(args, "--max-update") == "35000"
    # LION-D/S read the grid in two snakes by default; LION-LIT, without decay, row by row
    assert option(args, "--lion-order") == "two_snake"
    assert option(run_stub(stub_bin, image, PRECISION="fp32", VARIANT="lit"), "--lion-order") == "row_major"
    assert "MAX_UPDATE (5) must exceed WARMUP_UPDATES (5)" in run_stub(stub_bin, image, ok=False, PRECISION="fp32",
                                                                       MAX_UPDATE="5", WARMUP_UPDATES="5")
    assert "VARIANT must be lit, d or s; got 'retnet'" in run_stub(stub_bin, argv, ok=False, VARIANT="retnet")
    assert "ORDER orders the pixels" in run_stub(stub_bin, argv, ok=False, ORDER="two_snake")


def test_finetune_metric_and_schedule_follow_the_task(stub_bin, glue_data, mlm, tmp_path):
    ckpt, _ = mlm
    args = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, ckpt, tmp_path], PRECISION="fp32")
    # 96 training rows, batches of 32, 10 epochs -> 30 updates, 6% warm-up -> 1
    assert option(args, "--max-update") == "30" and option(args, "--total-num-update") == "30"
    assert option(args, "--warmup-updates") == "1" and option(args, "--num-classes") == "2"
    assert option(args, "--best-checkpoint-metric") == "accuracy" and option(args, "--finetune-from-model") == str(ckpt)
    assert "--restore-file" not in args  # a rerun resumes from the save dir, not from the pretrained start
    # the arch and sizes the checkpoint was trained as, unless ARCH says otherwise
    assert option(args, "--arch") == "lion_s_tiny" and option(args, "--encoder-embed-dim") == "128"
    args = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, ckpt, tmp_path], ARCH="lion_s",
                    PRECISION="fp32")
    assert option(args, "--arch") == "lion_s" and "--encoder-embed-dim" not in args
    for name in ("CoLA", "cola"):  # a folder named cola-bin, say, was scored by accuracy
        args = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, ckpt, tmp_path], TASK=name,
                        PRECISION="fp32")
        assert "--report-mcc" in args and option(args, "--best-checkpoint-metric") == "mcc"
    # wrong settings are named before the checkpoint is read (here one that cannot be)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    out = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, junk, tmp_path], ok=False,
                   PRECISION="fp32", MAX_UPDATE="0")  # fairseq's polynomial decay asserted, naming nothing
    assert "MAX_UPDATE must be a whole number above 0" in out and "cannot be used" not in out, out
    out = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, junk, tmp_path], ok=False,
                   PRECISION="fp32", BATCH_SIZE="abc")  # was bash's "abc: unbound variable"
    assert "BATCH_SIZE must be a whole number above 0, got 'abc'" in out and "cannot be used" not in out, out
    args = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, ckpt, tmp_path], TASK="MRPC",
                    PRECISION="fp32")
    assert option(args, "--best-checkpoint-metric") == "acc_and_f1"
    out = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, tmp_path / "none.pt", tmp_path],
                   ok=False)
    assert "PRETRAINED_CHECKPOINT" in out and "not found" in out
    cut = tmp_path / "cut.pt"  # said once, before fairseq-train is launched to say it again
    cut.write_bytes(Path(ckpt).read_bytes()[:1000])
    out = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, cut, tmp_path], ok=False)
    assert out.count("truncated or corrupt") == 1 and "cannot be used" in out and "ARG " not in out, out
    # the length the encoder was pretrained at (roberta.base's 512, here 256), unless MAX_POSITIONS says otherwise
    state = torch.load(ckpt, weights_only=True)
    state["cfg"]["model"]["max_positions"] = 256
    longer = tmp_path / "longer.pt"
    torch.save(state, longer)
    args = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, longer, tmp_path], PRECISION="fp32")
    assert option(args, "--max-positions") == "256"
    args = run_stub(stub_bin, ["bash", RECIPES / "glue/finetune.sh", glue_data, longer, tmp_path], PRECISION="fp32",
                    MAX_POSITIONS="64")
    assert option(args, "--max-positions") == "64"


def test_hubs_encode_with_the_datas_sentencepiece_model(spm_data, mlm, tmp_path):
    """``from_pretrained(checkpoint_dir, checkpoint, data_bin)`` as the README shows it, with no ``bpe=``:
    the MLM's and the LM's hubs encode with the sentencepiece model preprocess.text wrote into the data
    folder (issue 28: they split on whitespace, and the sentence came out mostly <unk>)."""
    from lion_fairseq.models.lion_encoder import LionRobertaModel
    from lion_fairseq.models.lion_lm import LionLanguageModel

    sentence = "you may redistribute the program under the terms of this license ."  # the corpus is lower-case
    ckpt, _ = mlm
    roberta = LionRobertaModel.from_pretrained(str(ckpt.parent), ckpt.name, str(spm_data))
    run(["fairseq-train", spm_data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
         "lion_s_lm_tiny", "--tokens-per-sample", "64", "--batch-size", "4", "--max-update", "1", "--optimizer",
         "adam", "--lr", "1e-4", "--cpu", "--num-workers", "0", "--save-dir", tmp_path, "--disable-validation"])
    lm = LionLanguageModel.from_pretrained(str(tmp_path), "checkpoint_last.pt", str(spm_data))
    for hub in (roberta, lm):
        tokens = hub.encode(sentence)
        unk = hub.task.source_dictionary.unk()
        assert (tokens == unk).sum() == 0 and len(tokens) > len(sentence.split())
        assert hub.decode(tokens).strip() == sentence
    # bpe='sentencepiece' as fairseq users pass it, without sentencepiece_model: the data's model too (fairseq
    # looks beside the checkpoint only, and stopped at omegaconf's "Missing mandatory value")
    named = LionLanguageModel.from_pretrained(str(tmp_path), "checkpoint_last.pt", str(spm_data), bpe="sentencepiece")
    assert torch.equal(named.encode(sentence), lm.encode(sentence))
    # fairseq-interactive as the README runs it (no --bpe) read every word as <unk>; --bpe sentencepiece
    # alone stopped at the missing --sentencepiece-model
    for bpe in ([], ["--bpe", "sentencepiece"]):
        out = run(["fairseq-interactive", spm_data, "--user-dir", USER_DIR, "--task", "language_modeling", "--path",
                   tmp_path / "checkpoint_last.pt", "--beam", "2", "--max-len-a", "1", "--max-len-b", "3", "--cpu",
                   *bpe], stdin=sentence)
        source = next(line.split("\t")[1] for line in out.splitlines() if line.startswith("S-0"))
        assert "<unk>" not in source and len(source.split()) > len(sentence.split()), out[-2000:]
        assert next(line for line in out.splitlines() if line.startswith("D-0")).split("\t")[2].startswith(sentence)
        assert (f"no --bpe given: encoding with {spm_data / 'sentencepiece.bpe.model'}" in out) == (not bpe)
    # pieces typed in with --post-process sentencepiece, as before: not encoded a second time
    out = run(["fairseq-interactive", spm_data, "--user-dir", USER_DIR, "--task", "language_modeling", "--path",
               tmp_path / "checkpoint_last.pt", "--beam", "2", "--max-len-a", "1", "--max-len-b", "3", "--cpu",
               "--post-process", "sentencepiece"], stdin=lm.bpe.encode(sentence))
    assert "no --bpe given, and --post-process/--remove-bpe: the input is read as sentencepiece pieces" in out
    assert next(line for line in out.splitlines() if line.startswith("D-0")).split("\t")[2].startswith(sentence)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(spm_data / "dict.txt", bare)
    with pytest.raises(FileNotFoundError, match="pass sentencepiece_model=<its path>"):
        LionLanguageModel.from_pretrained(str(tmp_path), "checkpoint_last.pt", str(bare), bpe="sentencepiece")
    # the model beside the checkpoint, where the hubs look too: fairseq-interactive read every word as <unk>
    shutil.copy(spm_data / "sentencepiece.bpe.model", tmp_path)
    out = run(["fairseq-interactive", bare, "--user-dir", USER_DIR, "--task", "language_modeling", "--path",
               tmp_path / "checkpoint_last.pt", "--beam", "2", "--max-len-a", "1", "--max-len-b", "3", "--cpu"],
              stdin=sentence)
    assert f"no --bpe given: encoding with {tmp_path / 'sentencepiece.bpe.model'}" in out, out[-2000:]
    assert "<unk>" not in next(line for line in out.splitlines() if line.startswith("S-0")), out[-2000:]
