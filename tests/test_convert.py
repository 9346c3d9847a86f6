"""A softmax RoBERTa's checkpoint as the start of a LION encoder (issue 27, lion_fairseq/models/convert.py):
trained here by fairseq-train (legacy ``args``, as fairseq's released checkpoints), then loaded into
``lion_{lit,d,s}_tiny`` through ``--finetune-from-model``, ``model.load_state_dict`` and
``python -m lion_fairseq.convert``; tensors copied bit-identical, gates by the stated rule, the old
``decoder.sentence_encoder`` layout, and sizes that differ refused with the option named."""
import shutil
import subprocess
import sys

import pytest
import torch

import lion_fairseq  # noqa: F401  (registers the models, as --user-dir does)
from conftest import ROOT, USER_DIR, build_model, fairseq_cli
from lion_fairseq.models.convert import GATE_LOGIT

SIZE = ["--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
        "--encoder-attention-heads", "2"]
TRAIN = ["--cpu", "--num-workers", "0", "--seed", "1", "--optimizer", "adam", "--lr", "0.0005",
         "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "2", "--criterion", "masked_lm", "--task", "masked_lm",
         "--tokens-per-sample", "32", "--batch-size", "8", "--disable-validation", "--no-epoch-checkpoints",
         "--log-format", "json", "--log-interval", "1", "--no-progress-bar"]


@pytest.fixture(scope="module")
def roberta(text_data_bin, tmp_path_factory):
    """A tiny fairseq RoBERTa checkpoint (``--arch roberta_base`` at 2 x 64, 40 updates: attention that is
    not yet uniform), dict.txt beside it."""
    save = tmp_path_factory.mktemp("roberta")
    fairseq_cli("train", str(text_data_bin), *TRAIN, "--arch", "roberta_base", *SIZE, "--max-positions", "32",
                "--max-update", "40", "--lr", "0.002", "--save-dir", str(save))
    shutil.copy(text_data_bin / "dict.txt", save / "dict.txt")
    return save / "checkpoint_last.pt"


def teacher_state(path):
    state = torch.load(path, map_location="cpu", weights_only=False)["model"]
    return {k.replace("decoder.", "encoder.", 1): v for k, v in state.items()}


def lion(text_data_bin, arch, *extra):
    return build_model(text_data_bin, "masked_lm", "--arch", arch, *SIZE, "--tokens-per-sample", "32",
                       "--max-positions", "32", *extra)[1]


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_softmax_tensors_copied_and_gates_by_rule(roberta, text_data_bin, variant):
    teacher = teacher_state(roberta)
    model = lion(text_data_bin, f"lion_{variant}_tiny")
    model.load_state_dict(torch.load(roberta, map_location="cpu", weights_only=False)["model"], strict=True)
    mine = model.state_dict()
    shared = [k for k in mine if k in teacher]
    assert all(torch.equal(mine[k], teacher[k]) for k in shared)
    # everything of the teacher's is kept but its version buffer, and its positions where LION has none
    kept = {k for k in teacher if not k.endswith(".version")}
    if variant != "lit":
        kept = {k for k in kept if "embed_positions" not in k}
    assert kept == set(shared)
    new = sorted(set(mine) - set(teacher))
    for layer in (0, 1):
        attn = f"encoder.sentence_encoder.layers.{layer}.self_attn."
        if variant == "d":
            assert torch.equal(mine[attn + "gate_logit"], torch.full((2,), GATE_LOGIT))
        if variant == "s":
            assert torch.equal(mine[attn + "gate_proj.weight"], torch.zeros(2, 64))
            assert torch.equal(mine[attn + "gate_proj.bias"], torch.full((2,), GATE_LOGIT))
    assert len(new) == {"lit": 0, "d": 2, "s": 4}[variant]


def test_old_layout_loads_the_same(roberta, text_data_bin):
    """fairseq's released RoBERTa layout: ``decoder.sentence_encoder.*``, ``emb_layer_norm``, and one
    ``in_proj_weight`` per attention: the same LION weights as the current layout."""
    state = torch.load(roberta, map_location="cpu", weights_only=False)["model"]
    old = {}
    for k, v in state.items():
        k = k.replace("encoder.", "decoder.", 1).replace(".layernorm_embedding.", ".emb_layer_norm.")
        old[k] = v
    for layer in (0, 1):
        attn = f"decoder.sentence_encoder.layers.{layer}.self_attn."
        for kind in ("weight", "bias"):
            old[attn + "in_proj_" + kind] = torch.cat([old.pop(attn + p + "_proj." + kind) for p in "qkv"])
    a, b = lion(text_data_bin, "lion_s_tiny"), lion(text_data_bin, "lion_s_tiny")
    a.load_state_dict(state, strict=True)
    b.load_state_dict(old, strict=True)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("extra,option", [(["--encoder-ffn-embed-dim", "96"], "--encoder-ffn-embed-dim"),
                                          (["--encoder-layers", "3"], "--encoder-layers"),
                                          (["--max-positions", "40", "--tokens-per-sample", "40"], "--max-positions"),
                                          (["--encoder-normalize-before"], "--encoder-normalize-before")])
def test_a_different_size_is_refused_naming_the_option(roberta, text_data_bin, extra, option):
    state = torch.load(roberta, map_location="cpu", weights_only=False)["model"]
    model = build_model(text_data_bin, "masked_lm", "--arch", "lion_lit_tiny", *SIZE, "--tokens-per-sample", "32",
                        "--max-positions", "32", *extra)[1]
    with pytest.raises(ValueError, match=option):
        model.load_state_dict(state, strict=True)


def test_fewer_learned_positions_take_the_teachers_first(roberta, text_data_bin):
    teacher = teacher_state(roberta)["encoder.sentence_encoder.embed_positions.weight"]
    model = build_model(text_data_bin, "masked_lm", "--arch", "lion_lit_tiny", *SIZE, "--tokens-per-sample", "16",
                        "--max-positions", "16")[1]
    model.load_state_dict(torch.load(roberta, map_location="cpu", weights_only=False)["model"], strict=True)
    mine = model.state_dict()["encoder.sentence_encoder.embed_positions.weight"]
    assert torch.equal(mine, teacher[:mine.shape[0]]) and mine.shape[0] < teacher.shape[0]


def test_finetune_from_model_starts_lion_from_roberta(roberta, text_data_bin, tmp_path):
    """The command a user types: fairseq-train --arch lion_s_tiny --finetune-from-model roberta.pt; what was
    dropped and added is logged, and training runs from there."""
    proc = fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--arch", "lion_s_tiny", *SIZE,
                       "--max-update", "2", "--save-dir", str(tmp_path), "--finetune-from-model", str(roberta))
    log = proc.stdout + proc.stderr
    assert "dropped what this LION model has no use for" in log and "embed_positions" in log
    assert "gate_proj.bias" in log and "\"num_updates\": \"2\"" in log


def test_convert_command_then_hub_and_restore_file(roberta, text_data_bin, tmp_path):
    out = tmp_path / "lion_d.pt"
    run = subprocess.run([sys.executable, "-m", "lion_fairseq.convert", str(roberta), str(out), "--arch", "lion_d_tiny"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wrote" in run.stdout and out.exists()
    from lion_fairseq.models.lion_encoder import LionRobertaModel

    hub = LionRobertaModel.from_pretrained(str(tmp_path), "lion_d.pt", str(text_data_bin))
    teacher = teacher_state(roberta)
    assert torch.equal(hub.model.state_dict()["encoder.sentence_encoder.layers.1.fc2.weight"],
                       teacher["encoder.sentence_encoder.layers.1.fc2.weight"])
    assert torch.isfinite(hub.extract_features(hub.encode("the value of the"))).all()
    proc = fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--arch", "lion_d_tiny", *SIZE,
                       "--max-update", "1", "--save-dir", str(tmp_path / "run"), "--restore-file", str(out),
                       "--reset-optimizer", "--reset-dataloader", "--reset-meters", "--reset-lr-scheduler")
    assert "num_updates" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "lion_fairseq.convert", str(roberta), str(tmp_path / "x.pt"),
                          "--arch", "lion_s_tiny", "--encoder-layers", "4"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "--encoder-layers" in bad.stderr and "Traceback" not in bad.stderr


def test_attention_transfer_trains_only_the_chosen_parts(roberta, text_data_bin, tmp_path):
    """``--criterion lion_attention_transfer`` through fairseq-train: only q, k and the gates move, everything
    else stays bit-identical to the converted start."""
    fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--arch", "lion_s_tiny", *SIZE,
                "--criterion", "lion_attention_transfer", "--teacher", str(roberta), "--max-update", "4",
                "--save-dir", str(tmp_path), "--finetune-from-model", str(roberta))
    start = lion(text_data_bin, "lion_s_tiny")
    start.load_state_dict(torch.load(roberta, map_location="cpu", weights_only=False)["model"], strict=True)
    before = start.state_dict()
    after = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    expect = {f"encoder.sentence_encoder.layers.{i}.self_attn.{p}" for i in (0, 1)
              for p in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "gate_proj.weight",
                        "gate_proj.bias")}
    assert moved == expect


def test_attention_transfer_loss_falls(roberta, text_data_bin):
    """On one batch, Adam on what the criterion trains: the share of the teacher's attention output that
    the LION attentions do not reproduce falls."""
    from fairseq.criterions import CRITERION_REGISTRY

    task, model = build_model(text_data_bin, "masked_lm", "--arch", "lion_d_tiny", *SIZE, "--tokens-per-sample",
                              "32", "--max-positions", "32", "--dropout", "0")
    model.load_state_dict(torch.load(roberta, map_location="cpu", weights_only=False)["model"], strict=True)
    criterion = CRITERION_REGISTRY["lion_attention_transfer"](task, teacher=str(roberta))
    task.load_dataset("valid")
    batch = task.dataset("valid").collater([task.dataset("valid")[i] for i in range(8)])
    opt = torch.optim.Adam([p for p in model.parameters()], lr=3e-3)

    def share():
        _, _, log = criterion(model, batch)
        return float(log["rel_num"] / log["rel_den"])

    first = share()
    for _ in range(30):
        opt.zero_grad()
        criterion(model, batch)[0].backward()
        opt.step()
    assert share() < 0.7 * first


def test_attention_transfer_refuses_unknown_parts(roberta, text_data_bin, tmp_path):
    with pytest.raises(AssertionError, match="--transfer-params"):
        fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--arch", "lion_s_tiny", *SIZE,
                    "--criterion", "lion_attention_transfer", "--teacher", str(roberta), "--transfer-params", "q,k",
                    "--max-update", "1", "--save-dir", str(tmp_path))
