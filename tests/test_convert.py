"""A softmax checkpoint as the start of a LION model (issue 27, lion_fairseq/models/convert.py): fairseq's
RoBERTa, ``transformer_lm`` and ``transformer``, each trained here by fairseq-train, then loaded into the
LION archs through ``--finetune-from-model``, ``--restore-file``, ``model.load_state_dict`` and ``python -m
lion_fairseq.convert``; tensors copied bit-identical, gates by the stated rule, positions kept or dropped,
the old ``decoder.sentence_encoder`` layout, and sizes or structures that differ refused with the option
named."""
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import lion_fairseq  # noqa: F401  (registers the models, as --user-dir does)
from conftest import ROOT, USER_DIR, build_model, fairseq_cli, preprocess, training_args
from lion_fairseq.models.convert import GATE_LOGIT

SIZE = ["--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
        "--encoder-attention-heads", "2"]
TRAIN = ["--cpu", "--num-workers", "0", "--seed", "1", "--optimizer", "adam", "--lr", "0.0005",
         "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "2", "--criterion", "masked_lm", "--task", "masked_lm",
         "--tokens-per-sample", "32", "--batch-size", "8", "--disable-validation", "--no-epoch-checkpoints",
         "--log-format", "json", "--log-interval", "1", "--no-progress-bar"]
# For the teachers, trained without the plugin: fairseq's prefetching thread can abort a run at exit after it
# has saved (the plugin's clean_exit hook guards LION runs only); no thread, no abort, the same checkpoint.
NO_PREFETCH = ["--data-buffer-size", "0"]


@pytest.fixture(scope="module")
def roberta(text_data_bin, tmp_path_factory):
    """A tiny fairseq RoBERTa checkpoint (``--arch roberta_base`` at 2 x 64, 40 updates: attention that is
    not yet uniform), dict.txt beside it."""
    save = tmp_path_factory.mktemp("roberta")
    fairseq_cli("train", str(text_data_bin), *TRAIN, "--arch", "roberta_base", *SIZE, "--max-positions", "32",
                "--max-update", "40", "--lr", "0.002", "--save-dir", str(save), *NO_PREFETCH)
    shutil.copy(text_data_bin / "dict.txt", save / "dict.txt")
    return save / "checkpoint_last.pt"


def test_convert_a_fine_tuned_roberta_classifier(roberta, labelled_data_bin, tmp_path):
    """A RoBERTa fine-tuned with --task sentence_prediction (a GLUE model) converts under that task: its
    data folder has input0/ and label/ dictionaries, and its classification head comes with it. The file
    keeps how the teacher read its data (``<s>`` first, the separator, truncation), which fairseq-validate
    and the hubs take from it: without them the head would read the first word instead of ``<s>``."""
    from lion_fairseq.convert import main
    from lion_fairseq.models.lion_encoder import LionRobertaModel

    data = labelled_data_bin
    # --user-dir: RoBERTa's checkpoint holds an argparse.Namespace, which the plugin allows torch to load
    fairseq_cli("train", str(data), "--user-dir", USER_DIR, *TRAIN[:TRAIN.index("--criterion")], "--task",
                "sentence_prediction", "--criterion", "sentence_prediction", "--arch", "roberta_base", *SIZE,
                "--num-classes", "2", "--max-positions", "32", "--init-token", "0", "--separator-token", "2",
                "--shorten-method", "truncate", "--batch-size", "8",
                "--restore-file", str(roberta), "--reset-optimizer", "--reset-dataloader", "--reset-meters",
                "--max-update", "4", "--disable-validation", "--no-epoch-checkpoints", "--save-dir",
                str(tmp_path / "cls"))
    teacher = tmp_path / "cls" / "checkpoint_last.pt"
    out = tmp_path / "lion_cls.pt"
    assert main([str(teacher), str(out), "--arch", "lion_s_tiny", "--data", str(data)]) == 0
    task = torch.load(out, weights_only=False)["cfg"]["task"]
    teacher_task = torch.load(teacher, weights_only=False)["cfg"]["task"]
    assert task["init_token"] == 0 and task["separator_token"] == 2 and task["shorten_method"] == "truncate"
    assert {k: v for k, v in task.items() if k != "data"} == {k: v for k, v in teacher_task.items() if k != "data"}
    hub = LionRobertaModel.from_pretrained(str(tmp_path), out.name, str(data))
    head = "classification_heads.sentence_classification_head.out_proj.weight"
    assert torch.equal(hub.model.state_dict()[head], state_of(teacher)[head])
    assert hub.predict("sentence_classification_head", hub.encode("the object is returned")).shape == (1, 2)


def assert_gates_by_rule(state, layers: str, variant: str) -> None:
    """Both layers' gates at the conversion's rule: LION-D's logits at GATE_LOGIT, LION-S's projection with
    zero weights and GATE_LOGIT biases (2 heads, width 64)."""
    for layer in (0, 1):
        attn = f"{layers}{layer}.self_attn."
        if variant == "d":
            assert torch.equal(state[attn + "gate_logit"], torch.full((2,), GATE_LOGIT))
        if variant == "s":
            assert torch.equal(state[attn + "gate_proj.weight"], torch.zeros(2, 64))
            assert torch.equal(state[attn + "gate_proj.bias"], torch.full((2,), GATE_LOGIT))


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
    assert_gates_by_rule(mine, "encoder.sentence_encoder.layers.", variant)
    assert len(new) == {"lit": 0, "d": 2, "s": 4}[variant]


def released_layout(state):
    """A RoBERTa's weights as fairseq released ``roberta.base``: ``decoder.sentence_encoder.*``,
    ``emb_layer_norm``, one ``in_proj_weight`` per attention, and no ``version`` buffer (fairseq 0.9's
    ``TransformerSentenceEncoder`` had none)."""
    old = {}
    for k, v in state.items():
        if not k.endswith("sentence_encoder.version"):
            old[k.replace("encoder.", "decoder.", 1).replace(".layernorm_embedding.", ".emb_layer_norm.")] = v
    for layer in (0, 1):
        attn = f"decoder.sentence_encoder.layers.{layer}.self_attn."
        for kind in ("weight", "bias"):
            old[attn + "in_proj_" + kind] = torch.cat([old.pop(attn + p + "_proj." + kind) for p in "qkv"])
    return old


def test_old_layout_loads_the_same(roberta, text_data_bin):
    """fairseq's released RoBERTa layout: the same LION weights as the current layout."""
    state = torch.load(roberta, map_location="cpu", weights_only=False)["model"]
    old = released_layout(state)
    a, b = lion(text_data_bin, "lion_s_tiny"), lion(text_data_bin, "lion_s_tiny")
    a.load_state_dict(state, strict=True)
    b.load_state_dict(old, strict=True)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_convert_a_roberta_saved_as_released(roberta, tmp_path):
    """``roberta.base`` as released: legacy ``args`` naming gpt2 BPE, the old layout with combined ``in_proj``
    and no ``version`` buffer. It converts to the same LION weights as the current layout, and the file keeps
    the teacher's BPE, which the hub encodes with (without it the hub splits text on whitespace)."""
    import argparse

    from lion_fairseq import convert

    state = torch.load(roberta, map_location="cpu", weights_only=False)
    old = released_layout(state["model"])
    args = argparse.Namespace(**dict(convert.teacher_config(state), arch="roberta_base", task="masked_lm", bpe="gpt2",
                                     mask_prob=0.2))  # a task setting of the flat legacy args
    released = tmp_path / "released"
    released.mkdir()
    torch.save({"args": args, "model": old, "optimizer_history": [{"num_updates": 40}], "extra_state": {},
                "last_optimizer_state": None}, released / "model.pt")
    shutil.copy(roberta.parent / "dict.txt", released / "dict.txt")
    assert convert.main([str(roberta), str(tmp_path / "current.pt"), "--arch", "lion_s_tiny"]) == 0
    assert convert.main([str(released / "model.pt"), str(tmp_path / "released.pt"), "--arch", "lion_s_tiny"]) == 0
    current, converted = (torch.load(tmp_path / f, weights_only=True) for f in ("current.pt", "released.pt"))
    assert current["model"].keys() == converted["model"].keys()
    assert all(torch.equal(current["model"][k], converted["model"][k]) for k in current["model"])
    assert converted["cfg"]["bpe"]["_name"] == "gpt2" and current["cfg"]["bpe"] is None
    assert converted["cfg"]["task"]["mask_prob"] == 0.2 and current["cfg"]["task"]["mask_prob"] == 0.15
    from lion_fairseq.check_checkpoint import explain

    for teacher in (roberta, released / "model.pt"):  # the dataclass config's Namespace, and legacy args
        text = explain(str(teacher))
        assert "model/arch 'roberta_base', task 'masked_lm'" in text and "lion_fairseq.convert" in text, text
        # as its config says, not "lion_lit (no gates) or a softmax Transformer"
        assert "updates, a softmax Transformer, 2 layers" in text and "(no gates)" not in text, text


def test_convert_takes_a_robertas_activations_from_its_config(roberta, tmp_path, capsys):
    """The weights do not show the activation: a RoBERTa trained with relu (and a tanh-free pooler) converts so,
    and the command it prints carries them on."""
    from lion_fairseq import convert

    state = torch.load(roberta, map_location="cpu", weights_only=False)
    vars(state["cfg"]["model"]).update(activation_fn="relu", pooler_activation_fn="linear")  # roberta's Namespace
    teacher = tmp_path / "relu" / "model.pt"
    teacher.parent.mkdir()
    torch.save(state, teacher)
    shutil.copy(roberta.parent / "dict.txt", teacher.parent / "dict.txt")
    assert convert.main([str(teacher), str(tmp_path / "lion.pt"), "--arch", "lion_s_tiny"]) == 0
    model = torch.load(tmp_path / "lion.pt", weights_only=True)["cfg"]["model"]
    assert (model["activation_fn"], model["pooler_activation_fn"]) == ("relu", "linear")
    assert "--activation-fn relu --pooler-activation-fn linear" in capsys.readouterr().out


def test_check_checkpoint_options_of_a_softmax_roberta_build_the_lion_model_it_starts(roberta, text_data_bin, capsys):
    """glue/finetune.sh fine-tunes with ``check_checkpoint --options``: for a RoBERTa of other sizes than base
    they were empty, and the recipe stopped asking for the heads that the checkpoint's config holds."""
    from lion_fairseq.check_checkpoint import main

    assert main(["--options", "--max-positions", str(roberta)]) == 0
    options, positions = capsys.readouterr().out.splitlines()
    assert options.startswith("--arch lion_s ") and "--encoder-attention-heads 2" in options, options
    model = build_model(text_data_bin, "masked_lm", *shlex.split(options), "--max-positions", positions,
                        "--tokens-per-sample", positions)[1]
    model.load_state_dict(teacher_state(roberta), strict=True)
    assert model.encoder.sentence_encoder.layers[0].self_attn.num_heads == 2


@pytest.mark.parametrize("extra,option", [(["--encoder-ffn-embed-dim", "96"], "--encoder-ffn-embed-dim"),
                                          # the same words, another width: not the dictionary's fault
                                          (["--encoder-embed-dim", "32"], "--encoder-embed-dim"),
                                          (["--encoder-layers", "3"], "--encoder-layers"),
                                          (["--max-positions", "40", "--tokens-per-sample", "40"], "--max-positions"),
                                          (["--encoder-normalize-before"], "--encoder-normalize-before")])
def test_a_different_size_is_refused_naming_the_option(roberta, text_data_bin, extra, option):
    state = torch.load(roberta, map_location="cpu", weights_only=False)["model"]
    model = build_model(text_data_bin, "masked_lm", "--arch", "lion_lit_tiny", *SIZE, "--tokens-per-sample", "32",
                        "--max-positions", "32", *extra)[1]
    with pytest.raises(ValueError, match=option):
        model.load_state_dict(state, strict=True)


def test_every_size_that_differs_is_named_at_once_with_the_teachers_values(roberta, text_data_bin):
    """A user found the teacher's sizes one failed run at a time (layers, then width, then FFN)."""
    state = torch.load(roberta, map_location="cpu", weights_only=False)["model"]
    model = build_model(text_data_bin, "masked_lm", "--arch", "lion_s_tiny", "--tokens-per-sample", "32",
                        "--max-positions", "32")[1]  # 2 x 128, FFN 512 (the teacher: 2 x 64, FFN 128)
    with pytest.raises(ValueError, match=re.escape(
            "encoder width 64 (this model 128), encoder FFN 128 (this model 512): pass --encoder-embed-dim 64 "
            "--encoder-ffn-embed-dim 128, and the teacher's --encoder-attention-heads (a divisor of 64)")):
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
    heads = SIZE[SIZE.index("--encoder-attention-heads") + 1]
    assert f"not in the weights, so taken from this model's options (pass the teacher's where they differ): " \
           f"{heads} heads, post-norm layers, activation gelu" in log


def test_convert_command_then_hub_and_restore_file(roberta, text_data_bin, tmp_path, capsys):
    out = tmp_path / "lion_d.pt"
    # an output path relative to the folder it runs in, as typed
    run = subprocess.run([sys.executable, "-m", "lion_fairseq.convert", str(roberta), out.name, "--arch", "lion_d_tiny"],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wrote" in run.stdout and out.exists()
    # what it dropped, added and took from the options is logged, as under fairseq-train
    assert "lion: added what LION has and the checkpoint lacks" in run.stderr, run.stderr[-2000:]
    assert "lion: not in the weights, so taken from this model's options" in run.stderr
    assert "Warning" not in run.stderr, run.stderr[-2000:]  # hydra's deprecation notices about fairseq
    from lion_fairseq.models.lion_encoder import LionRobertaModel

    # the hub call it prints loads the file from anywhere: its folder is absolute
    folder = re.search(r"LionRobertaModel\.from_pretrained\('([^']+)', 'lion_d\.pt', <data>\)", run.stdout)
    assert folder and folder[1] == str(tmp_path), run.stdout
    hub = LionRobertaModel.from_pretrained(folder[1], "lion_d.pt", str(text_data_bin))
    teacher = teacher_state(roberta)
    assert torch.equal(hub.model.state_dict()["encoder.sentence_encoder.layers.1.fc2.weight"],
                       teacher["encoder.sentence_encoder.layers.1.fc2.weight"])
    assert torch.isfinite(hub.extract_features(hub.encode("the value of the"))).all()
    proc = fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--arch", "lion_d_tiny", *SIZE,
                       "--max-update", "1", "--save-dir", str(tmp_path / "run"), "--restore-file", str(out),
                       "--reset-optimizer", "--reset-meters", "--reset-lr-scheduler")
    # the converted file starts a run at epoch 1, as a new one, also where the data loader's state is read from it
    assert "num_updates" in proc.stdout and "begin training epoch 1" in proc.stdout, proc.stdout[-2000:]
    assert "epoch 0" not in proc.stdout
    # a file converted before convert wrote its epoch starts at 1 too
    from fairseq import checkpoint_utils

    older = torch.load(out, weights_only=True)
    del older["extra_state"]["train_iterator"]
    torch.save(older, tmp_path / "older.pt")
    assert checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "older.pt"))["extra_state"]["train_iterator"][
        "epoch"] == 1
    bad = subprocess.run([sys.executable, "-m", "lion_fairseq.convert", str(roberta), str(tmp_path / "x.pt"),
                          "--arch", "lion_s_tiny", "--encoder-layers", "4"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "--encoder-layers" in bad.stderr and "Traceback" not in bad.stderr
    # a converted file given again: nothing to convert, and what to do with it (it named a RoBERTa to pick)
    from lion_fairseq import convert

    assert convert.main([str(out), str(tmp_path / "again.pt"), "--arch", "lion_d_tiny"]) == 2
    err = capsys.readouterr().err
    assert "already a LION model (lion_roberta, --arch lion_d_tiny): nothing to convert" in err
    assert "fairseq-train --arch lion_d_tiny --finetune-from-model" in err and "softmax checkpoint" not in err
    # asked for another variant: fairseq-train would refuse the file, so the advice is the teacher
    assert convert.main([str(out), str(tmp_path / "again.pt"), "--arch", "lion_s_tiny"]) == 2
    assert "for --arch lion_s_tiny, convert the softmax checkpoint it started from" in capsys.readouterr().err


def test_convert_refuses_an_output_path_it_cannot_write_before_converting(roberta, capsys, tmp_path):
    """An output in a folder that does not exist, or a folder itself, is refused naming the fix, before the
    conversion runs (not by torch.save at its end)."""
    from lion_fairseq import convert

    assert convert.main([str(roberta), str(tmp_path / "no" / "lion.pt"), "--arch", "lion_d_tiny"]) == 2
    assert "does not exist: create it" in capsys.readouterr().err
    assert convert.main([str(roberta), str(tmp_path), "--arch", "lion_d_tiny"]) == 2
    assert "is a folder: pass the LION checkpoint's file path" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    # a conversion run again replaces its own file; any other file (a trained model: here the teacher's
    # copy) is refused, not overwritten
    assert convert.main([str(roberta), str(tmp_path / "lion.pt"), "--arch", "lion_d_tiny"]) == 0
    assert convert.main([str(roberta), str(tmp_path / "lion.pt"), "--arch", "lion_d_tiny"]) == 0
    trained = tmp_path / "trained.pt"
    shutil.copy(roberta, trained)
    before = trained.read_bytes()
    assert convert.main([str(roberta), str(trained), "--arch", "lion_d_tiny"]) == 2
    assert f"the output {trained} exists and was not written by this command" in capsys.readouterr().err
    assert trained.read_bytes() == before
    torch.save({"model": {}, "extra_state": {"epoch": 2}}, trained)  # loads with weights_only, as a LION one does
    assert not convert.converted_before(str(trained)) and convert.converted_before(str(tmp_path / "lion.pt"))


def test_restore_file_of_another_models_optimizer_names_reset_optimizer(roberta, text_data_bin, tmp_path):
    """--restore-file of the softmax teacher without --reset-optimizer: its Adam state is of other
    parameters, and the message names the flags that start from its weights instead of torch's own."""
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", str(text_data_bin), "--user-dir", USER_DIR,
                           *TRAIN, "--arch", "lion_s_tiny", *SIZE, "--max-update", "1", "--save-dir", str(tmp_path),
                           "--restore-file", str(roberta)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert "cannot resume the optimizer of" in proc.stderr and "--reset-optimizer" in proc.stderr, proc.stderr[-2000:]


def test_restore_file_of_a_teacher_of_other_sizes_names_its_heads(roberta, text_data_bin, tmp_path):
    """A RoBERTa of other sizes than the arch's: its weights show the sizes, not the heads, which its config
    holds; the message gives them (it asked for "the teacher's --encoder-attention-heads")."""
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", str(text_data_bin), "--user-dir", USER_DIR,
                           *TRAIN, "--arch", "lion_s_tiny", "--max-update", "1", "--save-dir", str(tmp_path),
                           "--restore-file", str(roberta), "--reset-optimizer", "--reset-dataloader"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "Its config gives LION-S of its kind as --arch lion_s --encoder-layers 2 " \
        "--encoder-embed-dim 64 --encoder-ffn-embed-dim 128 --encoder-attention-heads 2" in last, proc.stderr[-2000:]


def test_convert_refuses_to_write_over_its_input(roberta, tmp_path):
    """The teacher is data: an output path that names it (here through a symbolic link) is refused, the
    file left as it was."""
    from lion_fairseq import convert

    teacher = tmp_path / "teacher.pt"
    teacher.write_bytes(roberta.read_bytes())
    shutil.copy(roberta.parent / "dict.txt", tmp_path / "dict.txt")
    (tmp_path / "link.pt").symlink_to(teacher)
    assert convert.main([str(teacher), str(tmp_path / "link.pt"), "--arch", "lion_d_tiny"]) == 2
    assert teacher.read_bytes() == roberta.read_bytes()


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


def converted_student(roberta, text_data_bin):
    """(task, model, criterion): a LION-D student holding the RoBERTa teacher's weights, and the transfer
    criterion towards that teacher."""
    from fairseq.criterions import CRITERION_REGISTRY

    task, model = build_model(text_data_bin, "masked_lm", "--arch", "lion_d_tiny", *SIZE, "--tokens-per-sample",
                              "32", "--max-positions", "32", "--dropout", "0")
    model.load_state_dict(torch.load(roberta, map_location="cpu", weights_only=False)["model"], strict=True)
    return task, model, CRITERION_REGISTRY["lion_attention_transfer"](task, teacher=str(roberta))


def test_attention_transfer_loss_falls(roberta, text_data_bin):
    """On one batch, Adam on what the criterion trains: the share of the teacher's attention output that
    the LION attentions do not reproduce falls."""
    task, model, criterion = converted_student(roberta, text_data_bin)
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


def test_attention_transfer_pairs_every_layer_under_layerdrop(roberta, text_data_bin):
    """With --encoder-layerdrop, training mode: the loss still pairs each student layer with its teacher
    layer (iterating fairseq's LayerDropModuleList skipped layers, and paired the rest with the wrong ones)."""
    from fairseq.criterions import CRITERION_REGISTRY

    task, model = build_model(text_data_bin, "masked_lm", "--arch", "lion_d_tiny", *SIZE, "--tokens-per-sample",
                              "32", "--max-positions", "32", "--dropout", "0", "--encoder-layerdrop", "0.99")
    model.load_state_dict(torch.load(roberta, map_location="cpu", weights_only=False)["model"], strict=True)
    criterion = CRITERION_REGISTRY["lion_attention_transfer"](task, teacher=str(roberta))
    task.load_dataset("valid")
    batch = task.dataset("valid").collater([task.dataset("valid")[i] for i in range(4)])
    with torch.no_grad():
        trained = criterion(model.train(), batch)[2]
        evaluated = criterion(model.eval(), batch)[2]
    for key in ("rel_num", "rel_den"):
        torch.testing.assert_close(trained[key], evaluated[key])


def test_attention_transfer_leaves_padding_out(roberta, text_data_bin):
    """The loss and its logged error over a padded batch are those of its sequences alone, token-weighted:
    padding neither reaches the student's attention nor counts as tokens."""
    task, model, criterion = converted_student(roberta, text_data_bin)
    task.load_dataset("valid")
    ds = task.dataset("valid")
    by_length = sorted(range(len(ds)), key=lambda i: ds[i]["net_input.src_tokens"].numel())
    items = [ds[by_length[0]], ds[by_length[-1]]]
    assert items[0]["net_input.src_tokens"].numel() < items[1]["net_input.src_tokens"].numel()
    model.eval()
    with torch.no_grad():
        loss, _, log = criterion(model, ds.collater(items))
        alone = [criterion(model, ds.collater([item])) for item in items]
    tokens = [item["net_input.src_tokens"].numel() for item in items]
    for key in ("rel_num", "rel_den"):
        torch.testing.assert_close(log[key], sum(a[2][key] for a in alone), rtol=1e-5, atol=0)
    torch.testing.assert_close(loss * sum(tokens), sum(a[0] * n for a, n in zip(alone, tokens)), rtol=1e-5, atol=0)


def test_attention_transfer_of_every_part_starts_from_any_student(roberta, text_data_bin):
    """Where --transfer-params trains v_proj and out_proj too, nothing stays frozen at random values: a
    student that did not start from the teacher trains, where the default parts stop it."""
    from fairseq.criterions import CRITERION_REGISTRY

    task, model = build_model(text_data_bin, "masked_lm", "--arch", "lion_s_tiny", *SIZE, "--tokens-per-sample",
                              "32", "--max-positions", "32")
    task.load_dataset("valid")
    batch = task.dataset("valid").collater([task.dataset("valid")[i] for i in range(2)])
    every = CRITERION_REGISTRY["lion_attention_transfer"](task, teacher=str(roberta),
                                                          transfer_params="q_proj,k_proj,v_proj,out_proj,gate")
    assert torch.isfinite(every(model, batch)[0])
    with pytest.raises(ValueError, match="did not start from the teacher"):
        CRITERION_REGISTRY["lion_attention_transfer"](task, teacher=str(roberta))(model, batch)


def test_attention_transfer_refuses_a_student_that_did_not_start_from_the_teacher(roberta, text_data_bin, tmp_path):
    """Without --finetune-from-model the student's v and output projections are random and stay frozen: the
    transfer ran, its rel_err near 1.8, without a word. It stops naming the option."""
    with pytest.raises(AssertionError, match=r"did not start from the teacher \(layer 0's v_proj differs\).*"
                                             r"--finetune-from-model <the --teacher checkpoint>"):
        fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--arch", "lion_s_tiny", *SIZE,
                    "--criterion", "lion_attention_transfer", "--teacher", str(roberta), "--max-update", "1",
                    "--save-dir", str(tmp_path))


def test_attention_transfer_refuses_a_ddp_backend_that_would_not_average_its_gradients(roberta, text_data_bin):
    """Over several processes torch's DDP (--ddp-backend pytorch_ddp, fairseq's default) averages only what the
    model's forward ran, and the transfer runs the student's layers itself: each process trained on its own
    batches, the ranks drifting apart without a word on CPU (found with two gloo ranks)."""
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def criterion(*extra: str):
        cfg = convert_namespace_to_omegaconf(training_args(
            text_data_bin, "masked_lm", "--arch", "lion_s_tiny", *SIZE, "--criterion", "lion_attention_transfer",
            "--teacher", str(roberta), *extra))
        return tasks.setup_task(cfg.task).build_criterion(cfg.criterion)

    two = ["--distributed-world-size", "2"]
    for extra in ([], ["--ddp-backend", "c10d"], [*two, "--ddp-backend", "legacy_ddp"],
                  [*two, "--ddp-backend", "no_c10d"]):
        assert criterion(*extra).trained, extra
    for backend in ("pytorch_ddp", "c10d"):
        with pytest.raises(ValueError, match=rf"with 2 processes needs --ddp-backend legacy_ddp .* {backend} needs"):
            criterion(*two, "--ddp-backend", backend)


def test_attention_transfer_refuses_unknown_parts(roberta, text_data_bin, tmp_path):
    from lion_fairseq.criterions.attention_transfer import trained_parts

    with pytest.raises(ValueError, match="--transfer-params"):
        trained_parts(" , ")  # nothing to train: the run would change nothing
    with pytest.raises(AssertionError, match="--transfer-params"):
        fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--arch", "lion_s_tiny", *SIZE,
                    "--criterion", "lion_attention_transfer", "--teacher", str(roberta), "--transfer-params", "q,k",
                    "--max-update", "1", "--save-dir", str(tmp_path))


def test_attention_transfer_refuses_a_teacher_that_is_not_a_softmax_roberta(roberta, transformer_lm,
                                                                            text_data_bin, tmp_path):
    """--teacher must be a softmax RoBERTa of the student's width: a LION checkpoint trained the student
    towards another LION without a word, a transformer_lm failed deep in fairseq's loading, a wider student
    in the attention's own shape check."""
    from lion_fairseq import convert
    from lion_fairseq.criterions.attention_transfer import check_teacher

    check_teacher(str(roberta))
    assert convert.main([str(roberta), str(tmp_path / "lion.pt"), "--arch", "lion_d_tiny"]) == 0
    for teacher, kind in ((tmp_path / "lion.pt", "lion_roberta"), (transformer_lm, "transformer_lm")):
        with pytest.raises(ValueError, match=f"holds a {kind} .*not a softmax RoBERTa"):
            check_teacher(str(teacher))
    with pytest.raises(AssertionError, match="the teacher is 64 wide and the model 32: pass the teacher's "
                                             "--encoder-embed-dim"):
        fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--arch", "lion_s_tiny", *SIZE,
                    "--encoder-embed-dim", "32", "--criterion", "lion_attention_transfer", "--teacher", str(roberta),
                    "--max-update", "1", "--save-dir", str(tmp_path / "run"))


# ---- fairseq's transformer_lm -> lion_lm ------------------------------------------------------------------

LM_SIZE = ["--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128",
           "--decoder-attention-heads", "2", "--tokens-per-sample", "32"]
# what fairseq's --arch transformer_lm is and its weights do not show: post-norm layers, relu
LM_STRUCTURE = ["--no-decoder-normalize-before", "--activation-fn", "relu"]
LM_TRAIN = ["--cpu", "--num-workers", "0", "--seed", "1", "--optimizer", "adam", "--lr", "0.002", "--lr-scheduler",
            "inverse_sqrt", "--warmup-updates", "2", "--criterion", "cross_entropy", "--task", "language_modeling",
            "--batch-size", "8", "--disable-validation", "--no-epoch-checkpoints", "--log-format", "json",
            "--log-interval", "1", "--no-progress-bar"]


@pytest.fixture(scope="module")
def transformer_lm(text_data_bin, tmp_path_factory):
    """A tiny fairseq ``--arch transformer_lm`` (its defaults: post-norm, no final LayerNorm, relu) at 2 x 64
    with learned positions, 40 updates; input and output dims set to the width, as LION has no projection."""
    save = tmp_path_factory.mktemp("transformer_lm")
    fairseq_cli("train", str(text_data_bin), *LM_TRAIN, "--arch", "transformer_lm", *LM_SIZE, "--decoder-input-dim",
                "64", "--decoder-output-dim", "64", "--decoder-learned-pos", "--batch-size", "16", "--lr", "0.005",
                "--warmup-updates", "4", "--max-update", "40", "--save-dir", str(save), *NO_PREFETCH)
    return save / "checkpoint_last.pt"


def test_fairseq_models_take_their_own_overrides_and_build_as_fairseq_builds_them(transformer_lm, roberta,
                                                                                  text_data_bin):
    """What the plugin checks on LION checkpoints leaves fairseq's own models as fairseq runs them: an
    --activation-fn override, refused on a LION checkpoint as another model on its weights, is applied to a
    transformer_lm or RoBERTa checkpoint, and language_modeling still takes any model with the targets it
    asks for (only where fairseq fails does the message say what the model is)."""
    from fairseq import checkpoint_utils

    for path in (transformer_lm, roberta):
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path), {"activation_fn": "gelu", "dropout": 0.0})
        model = state["cfg"]["model"]
        assert getattr(model, "activation_fn") == "gelu" and getattr(model, "dropout") == 0.0, path
    with pytest.raises(ValueError, match=r"takes causal language models.*holds a roberta model \(--arch "
                                         r"roberta_base\).*fairseq-validate") as e:
        build_model(text_data_bin, "language_modeling", "--arch", "roberta_base", *SIZE)
    assert "Unsupported language modeling target" in str(e.value.__cause__)
    assert str(e.value).endswith("a causal LION LM is an arch of lion_{lit,d,s}_lm[_tiny], lion_retnet_lm, "
                                 "lion_s_lm_plus[_tiny]")  # every registered one


def lion_lm(text_data_bin, arch, *extra):
    return build_model(text_data_bin, "language_modeling", "--arch", arch, *LM_SIZE, *LM_STRUCTURE, *extra)


def state_of(path):
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_lm_tensors_copied_gates_by_rule_positions_kept_or_dropped(transformer_lm, text_data_bin, variant):
    teacher = state_of(transformer_lm)
    model = lion_lm(text_data_bin, f"lion_{variant}_lm_tiny")[1]
    model.load_state_dict(state_of(transformer_lm), strict=True)
    mine = model.state_dict()
    assert all(torch.equal(mine[k], teacher[k]) for k in mine if k in teacher)
    kept = {k for k in teacher if k != "decoder.version"}
    if variant != "lit":  # LION-D/S have no positions
        kept.discard("decoder.embed_positions.weight")
    assert kept == set(mine) & set(teacher)
    new = set(mine) - set(teacher)
    assert len(new) == {"lit": 0, "d": 2, "s": 4}[variant]
    assert_gates_by_rule(mine, "decoder.layers.", variant)


def test_lm_a_tied_teacher_into_an_untied_model_is_said(transformer_lm, text_data_bin, caplog):
    """A teacher trained with --share-decoder-input-output-embed loads into a model without it (the same
    values twice), which then trains two tables: the log says so, naming the option; a tied model is quiet."""
    state = state_of(transformer_lm)
    state["decoder.output_projection.weight"] = state["decoder.embed_tokens.weight"]  # saved tied: one storage
    for tie, said in (([], True), (["--share-decoder-input-output-embed"], False)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            lion_lm(text_data_bin, "lion_s_lm_tiny", *tie)[1].load_state_dict(dict(state), strict=True)
        assert ("pass --share-decoder-input-output-embed" in caplog.text) == said, caplog.text


def valid_bits(task, model) -> float:
    """The valid split's cross-entropy in bits per token, as fairseq-validate reports it."""
    from fairseq.criterions.cross_entropy import CrossEntropyCriterion

    criterion, total, tokens = CrossEntropyCriterion(task, sentence_avg=False), 0.0, 0
    task.load_dataset("valid")
    data = task.dataset("valid")
    model.eval()
    with torch.no_grad():
        for start in range(0, len(data), 16):
            loss, n, _ = criterion(model, data.collater([data[i] for i in range(start, min(start + 16, len(data)))]))
            total, tokens = total + float(loss), tokens + n
    return total / tokens / math.log(2)


@pytest.mark.parametrize("variant", ["lit", "s"])
def test_lm_converted_keeps_what_the_teacher_learned(transformer_lm, text_data_bin, variant):
    """Measured: teacher 7.52 bits, converted LIT and S 7.54 and 7.53, fresh 11.8-12.1. A teacher of 40
    updates mostly knows token statistics, which the conversion keeps whole; the attention (softmax here,
    linear there) is where the two differ, and at this stage it adds little. So: the converted model keeps
    over 90% of the teacher's gain over a fresh LION model."""
    task, teacher = build_model(text_data_bin, "language_modeling", "--arch", "transformer_lm", *LM_SIZE,
                                "--decoder-input-dim", "64", "--decoder-output-dim", "64", "--decoder-learned-pos")
    teacher.load_state_dict(state_of(transformer_lm), strict=True)
    torch.manual_seed(0)
    task, model = lion_lm(text_data_bin, f"lion_{variant}_lm_tiny")
    fresh = valid_bits(task, model)
    model.load_state_dict(state_of(transformer_lm), strict=True)
    converted, taught = valid_bits(task, model), valid_bits(task, teacher)
    assert math.isfinite(converted) and converted - taught < 0.1 * (fresh - taught), (taught, converted, fresh)


def test_lm_an_embedding_layernorm_converts_and_embeds_as_the_teacher(text_data_bin):
    """A teacher with --layernorm-embedding (fairseq normalises the scaled, positioned embeddings) starts a
    LION LM built with it: every tensor is copied, and the converted model's input to its first layer is
    the teacher's, value for value (scale, positions and the LayerNorm, in fairseq's order)."""
    torch.manual_seed(0)
    task, teacher = build_model(text_data_bin, "language_modeling", "--arch", "transformer_lm", *LM_SIZE,
                                "--decoder-input-dim", "64", "--decoder-output-dim", "64", "--decoder-learned-pos",
                                "--layernorm-embedding")
    with torch.no_grad():  # not LayerNorm's initial ones and zeros, which a missing norm would nearly match
        for p in teacher.decoder.layernorm_embedding.parameters():
            p.normal_()
    model = lion_lm(text_data_bin, "lion_lit_lm_tiny", "--layernorm-embedding")[1]
    model.load_state_dict(dict(teacher.state_dict()), strict=True)
    mine, theirs = model.state_dict(), teacher.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    tokens = torch.randint(4, len(task.source_dictionary), (2, 12))
    teacher.eval(), model.eval()
    with torch.no_grad():
        expected, got = (m(tokens)[1]["inner_states"][0] for m in (teacher, model))
    torch.testing.assert_close(got, expected)


def _with(**extra_tensors):
    def edit(state):
        state.update({k: torch.zeros(shape) for k, shape in extra_tensors.items()})
    return edit


def _without(key):
    def edit(state):
        del state[key]
    return edit


@pytest.mark.parametrize("arch,extra,edit,option", [
    ("lion_s_lm_tiny", ["--decoder-ffn-embed-dim", "96"], None, "--decoder-ffn-embed-dim"),
    ("lion_s_lm_tiny", ["--decoder-layers", "3"], None, "--decoder-layers"),
    ("lion_lit_lm_tiny", ["--tokens-per-sample", "40"], None, "--tokens-per-sample"),
    ("lion_s_lm_tiny", ["--share-decoder-input-output-embed"], None, "drop --share-decoder-input-output-embed"),
    # pre-norm (the LION default) from a post-norm teacher: the final LayerNorm it lacks gives it away
    ("lion_s_lm_tiny", ["--decoder-normalize-before"], None, "--no-decoder-normalize-before"),
    # a pre-norm teacher (every named transformer_lm_* arch) into a post-norm model
    ("lion_s_lm_tiny", [], _with(**{"decoder.layer_norm.weight": (64,), "decoder.layer_norm.bias": (64,)}),
     "pass --decoder-normalize-before"),
    # sinusoidal positions (no weights) into LION-LIT's learned ones
    ("lion_lit_lm_tiny", [], _without("decoder.embed_positions.weight"), "--lion-positions none"),
    ("lion_s_lm_tiny", [], _with(**{"decoder.layernorm_embedding.weight": (64,),
                                    "decoder.layernorm_embedding.bias": (64,)}), "pass --layernorm-embedding"),
    ("lion_s_lm_tiny", ["--layernorm-embedding"], None, "drop --layernorm-embedding"),
    ("lion_s_lm_tiny", [], _with(**{"decoder.project_in_dim.weight": (64, 512)}), "--decoder-input-dim"),
    ("lion_s_lm_tiny", [], _with(**{"decoder.adaptive_softmax.head.weight": (4, 64)}), "--adaptive-softmax-cutoff"),
])
def test_lm_a_different_structure_is_refused_naming_the_option(transformer_lm, text_data_bin, arch, extra, edit,
                                                               option):
    state = state_of(transformer_lm)
    if edit is not None:
        edit(state)
    model = lion_lm(text_data_bin, arch, *extra)[1]
    with pytest.raises(ValueError, match=re.escape(option)):
        model.load_state_dict(state, strict=True)


def test_convert_prints_the_options_given_after_the_arch(roberta, tmp_path, capsys):
    """Options of the arch given to the conversion build the converted model, and the printed fairseq-train
    command passes them too: without them it would build another model from the file."""
    from lion_fairseq import convert

    assert convert.main([str(roberta), str(tmp_path / "lion.pt"), "--arch", "lion_s_tiny", "--lion-short-conv", "3"]) == 0
    assert "--lion-short-conv 3" in capsys.readouterr().out
    assert torch.load(tmp_path / "lion.pt", weights_only=True)["cfg"]["model"]["lion_short_conv"] == 3
    # a wrong one: argparse's line and where the options are listed, not fairseq-train's whole usage
    assert convert.main([str(roberta), str(tmp_path / "x.pt"), "--arch", "lion_s_tiny", "--lion-form", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err and "--arch lion_s_tiny --help" in err and "usage:" not in err, err
    assert not (tmp_path / "x.pt").exists()


def test_teacher_flags_leave_out_the_switches_the_user_gave_in_either_spelling():
    """The printed command gives the teacher's structure except where the user chose it: a pre-norm teacher
    and --no-decoder-normalize-before print neither spelling of the switch beside the user's."""
    from lion_fairseq.convert import TARGETS, teacher_flags

    lm = TARGETS["lion_lm"]
    assert teacher_flags({"decoder_normalize_before": True}, lm, []) == ["--decoder-normalize-before"]
    assert teacher_flags({"decoder_normalize_before": True}, lm, ["--no-decoder-normalize-before"]) == []
    assert teacher_flags({"decoder_normalize_before": False}, lm, ["--decoder-normalize-before"]) == []
    # a size given as --x=v is the user's too (the teacher's printed beside it, the later one winning)
    assert teacher_flags({"decoder_layers": 2}, lm, []) == ["--decoder-layers", "2"]
    assert teacher_flags({"decoder_layers": 2}, lm, ["--decoder-layers=3"]) == []


def test_check_checkpoint_says_why_a_teacher_cannot_convert(transformer_lm, tmp_path):
    """fairseq's transformer_lm with its default --decoder-input-dim 512 at another width: check_checkpoint
    recommended the conversion that then refused it."""
    from lion_fairseq.check_checkpoint import explain

    text = explain(str(transformer_lm))
    assert "python -m lion_fairseq.convert" in text
    assert "--arch lion_s_lm" in text  # an LM's LION, not translation's (its prefix)
    state = torch.load(transformer_lm, map_location="cpu", weights_only=False)
    state["model"]["decoder.project_in_dim.weight"] = torch.zeros(64, 512)
    torch.save(state, tmp_path / "projected.pt")
    text = explain(str(tmp_path / "projected.pt"))
    assert "LION cannot start from: the teacher's --decoder-input-dim" in text and "convert " not in text, text


def test_lm_finetune_from_model_and_restore_file_start_from_transformer_lm(transformer_lm, text_data_bin, tmp_path):
    """The commands a user types; what the weights cannot show is logged for them to check."""
    common = [str(text_data_bin), "--user-dir", USER_DIR, *LM_TRAIN, "--arch", "lion_s_lm_tiny", *LM_SIZE,
              *LM_STRUCTURE, "--max-update", "2"]
    proc = fairseq_cli("train", *common, "--save-dir", str(tmp_path / "a"), "--finetune-from-model",
                       str(transformer_lm))
    log = proc.stdout + proc.stderr
    assert "gate_proj.bias" in log and "post-norm layers without a final LayerNorm, activation relu" in log
    assert "\"num_updates\": \"2\"" in log and "another structure" not in log
    # the activation and head count the weights do not show, left at the arch's: said (it started silently)
    proc = fairseq_cli("train", *common, "--activation-fn", "gelu", "--decoder-attention-heads", "4", "--save-dir",
                       str(tmp_path / "b"), "--restore-file", str(transformer_lm), "--reset-optimizer",
                       "--reset-dataloader", "--reset-meters")
    assert "gate_proj.bias" in proc.stdout + proc.stderr and "\"num_updates\": \"2\"" in proc.stdout
    assert ("weights were trained with another structure than this model's: --activation-fn relu -> --activation-fn "
            "gelu; --decoder-attention-heads 2 -> --decoder-attention-heads 4") in proc.stdout + proc.stderr


def test_lm_convert_command_reads_the_structure_then_hub(transformer_lm, text_data_bin, tmp_path, capsys):
    """No size or structure option: the command takes them from the teacher's config (post-norm, relu,
    learned positions kept by LION-LIT)."""
    from lion_fairseq.convert import main
    from lion_fairseq.models.lion_lm import LionLanguageModel

    out = tmp_path / "lion_lit_lm.pt"
    # in process: the RoBERTa test above runs the same main() as `python -m lion_fairseq.convert`
    assert main([str(transformer_lm), str(out), "--arch", "lion_lit_lm_tiny", "--data", str(text_data_bin)]) == 0
    printed = capsys.readouterr().out
    assert "LionLanguageModel.from_pretrained" in printed
    # the command it prints gives the teacher's structure and the sizes the arch's differ in, and runs
    flags = shlex.split(printed.split(" --arch ")[1].split(" --finetune-from-model ")[0])
    assert {"--no-decoder-normalize-before", "relu", "--decoder-embed-dim"} <= set(flags)
    proc = fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, *LM_TRAIN, "--arch", *flags,
                       "--finetune-from-model", str(out), "--max-update", "1", "--save-dir", str(tmp_path / "run"))
    assert "\"num_updates\": \"1\"" in proc.stdout
    hub = LionLanguageModel.from_pretrained(str(tmp_path), out.name, str(text_data_bin))
    mine, teacher = hub.models[0].state_dict(), state_of(transformer_lm)
    assert all(torch.equal(mine[k], teacher[k]) for k in teacher if k != "decoder.version")
    assert not hub.models[0].decoder.layers[0].normalize_before and hub.models[0].decoder.layer_norm is None
    assert math.isfinite(float(hub.score("the value of the")["positional_scores"].mean()))
    assert main([str(transformer_lm), str(tmp_path / "x.pt"), "--arch", "lion_s_transformer_tiny", "--data",
                 str(text_data_bin)]) == 2
    assert "starts from a transformer" in capsys.readouterr().err


def test_lion_lm_checkpoints_saved_before_the_norm_options_load_pre_norm(text_data_bin, tmp_path):
    """A lion_lm config without ``decoder_normalize_before`` / ``no_decoder_final_norm`` (every checkpoint
    saved before they existed) builds today's pre-norm model with its final LayerNorm, weights unchanged."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    ns = training_args(text_data_bin, "language_modeling", "--arch", "lion_s_lm_tiny", "--tokens-per-sample", "32")
    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(ns), resolve=True, enum_to_str=True)
    del cfg["model"]["decoder_normalize_before"], cfg["model"]["no_decoder_final_norm"]
    weights = build_model(text_data_bin, "language_modeling", "--arch", "lion_s_lm_tiny",
                          "--tokens-per-sample", "32")[1].state_dict()
    history = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "none", "lr_scheduler_state": {},
                "num_updates": 0}]
    torch.save({"cfg": cfg, "args": None, "model": weights, "optimizer_history": history, "extra_state": {}},
               tmp_path / "old.pt")
    (model,), _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "old.pt")])
    assert model.decoder.layers[0].normalize_before and model.decoder.layer_norm is not None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


# ---- fairseq's transformer (translation) -> lion_transformer ---------------------------------------------

# lion_*_transformer_tiny's sizes
MT_SIZE = [arg for side in ("encoder", "decoder") for arg in (
    f"--{side}-layers", "2", f"--{side}-embed-dim", "128", f"--{side}-ffn-embed-dim", "256",
    f"--{side}-attention-heads", "2")]


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    from lion_fairseq.benchmark.translation import write_reversal_corpus

    root = tmp_path_factory.mktemp("reversal")
    write_reversal_corpus(root, sizes=(("train", 400), ("valid", 20), ("test", 20)))
    preprocess("--source-lang", "src", "--target-lang", "tgt", "--trainpref", str(root / "train"), "--validpref",
               str(root / "valid"), "--testpref", str(root / "test"), "--destdir", str(root / "bin"), "--workers", "1")
    return root / "bin"


MT_TRAIN = ["--task", "translation", "--optimizer", "adam", "--lr", "0.003", "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", "5", "--criterion", "cross_entropy", "--max-tokens", "1500", "--cpu", "--num-workers",
            "0", "--no-epoch-checkpoints", "--disable-validation", "--log-format", "json", "--log-interval", "1",
            "--no-progress-bar", "--seed", "1"]


@pytest.fixture(scope="module")
def transformer(mt_data, tmp_path_factory):
    """A tiny fairseq ``--arch transformer`` (post-norm, sinusoidal positions) at lion_*_transformer_tiny's
    sizes, 20 updates."""
    save = tmp_path_factory.mktemp("transformer")
    fairseq_cli("train", str(mt_data), *MT_TRAIN, "--arch", "transformer", *MT_SIZE, "--max-update", "20",
                "--save-dir", str(save), *NO_PREFETCH)
    return save / "checkpoint_last.pt"


@pytest.mark.parametrize("variant,cross,extra", [("lit", "softmax", ()), ("s", "softmax", ()), ("d", "linear", ()),
                                                 ("lit", "linear", ("--lion-norm-after",))])
def test_transformer_tensors_copied_gates_by_rule(transformer, mt_data, variant, cross, extra):
    """Every tensor of the teacher's loads as it is, the cross-attention's into fairseq's softmax attention
    or into the linear one (same names and shapes); only the gates (and ``--lion-norm-after``'s norms, as
    initialised, the cross-attention's too) are new."""
    teacher = state_of(transformer)
    model = build_model(mt_data, "translation", "--arch", f"lion_{variant}_transformer_tiny", "--lion-cross-attention",
                        cross, *extra)[1]
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state_of(transformer), strict=True)
    mine = model.state_dict()
    assert all(torch.equal(mine[k], teacher[k]) for k in teacher)
    assert type(model.decoder.layers[0].encoder_attn).__name__ == {"softmax": "MultiheadAttention",
                                                                   "linear": "LinearCrossAttention"}[cross]
    new = sorted(set(mine) - set(teacher))
    norms = [k for k in new if ".head_norm." in k]
    gates = [k for k in new if k not in norms]
    assert len(gates) == {"lit": 0, "d": 4, "s": 8}[variant]
    assert len(norms) == (2 * 6 if extra else 0)  # 4 self-attentions and 2 cross-attentions, weight and bias
    assert all(torch.equal(mine[k], fresh[k]) for k in norms)
    assert all(torch.equal(mine[k], torch.full((2,), GATE_LOGIT)) for k in gates if k.endswith(("gate_logit", ".bias")))
    assert all(torch.equal(mine[k], torch.zeros(2, 128)) for k in gates if k.endswith("gate_proj.weight"))


@pytest.mark.parametrize("extra,option", [(["--decoder-ffn-embed-dim", "128"], "--decoder-ffn-embed-dim"),
                                          (["--encoder-embed-dim", "64"], "--encoder-embed-dim"),
                                          (["--encoder-layers", "3"], "--encoder-layers"),
                                          (["--decoder-normalize-before"], "--decoder-normalize-before"),
                                          (["--lion-positions", "learned"], "drop --lion-positions learned")])
def test_transformer_a_different_structure_is_refused_naming_the_option(transformer, mt_data, extra, option):
    model = build_model(mt_data, "translation", "--arch", "lion_s_transformer_tiny", *extra)[1]
    with pytest.raises(ValueError, match=option):
        model.load_state_dict(state_of(transformer), strict=True)


def test_convert_asks_for_the_languages_a_teacher_did_not_record(transformer, mt_data, tmp_path, capsys):
    """A translation teacher trained without -s/-t records no languages, and its own folder holds only its
    dictionaries: convert asks for --source-lang and --target-lang (naming the dictionaries it found)
    instead of fairseq's 'Could not infer language pair', and converts with them."""
    from lion_fairseq.convert import main

    state = torch.load(transformer, map_location="cpu", weights_only=False)
    state["cfg"]["task"]["source_lang"] = state["cfg"]["task"]["target_lang"] = None
    torch.save(state, tmp_path / "teacher.pt")
    for lang in ("src", "tgt"):
        shutil.copy(mt_data / f"dict.{lang}.txt", tmp_path / f"dict.{lang}.txt")
    assert main([str(tmp_path / "teacher.pt"), str(tmp_path / "lion.pt"), "--arch", "lion_s_transformer_tiny"]) == 2
    err = capsys.readouterr().err
    assert "--source-lang and --target-lang (dictionaries there: dict.src.txt, dict.tgt.txt)" in err, err
    assert main([str(tmp_path / "teacher.pt"), str(tmp_path / "lion.pt"), "--arch", "lion_s_transformer_tiny",
                 "-s", "src", "-t", "tgt"]) == 0


def test_transformer_finetune_from_model_and_convert_command(transformer, mt_data, tmp_path):
    from lion_fairseq.convert import main
    from lion_fairseq.models.lion_transformer import LionTransformerModel

    proc = fairseq_cli("train", str(mt_data), "--user-dir", USER_DIR, *MT_TRAIN, "--arch", "lion_s_transformer_tiny",
                       "--max-update", "2", "--save-dir", str(tmp_path / "run"), "--finetune-from-model",
                       str(transformer))
    # what the weights cannot show is logged for the user to check against the teacher
    heads = MT_SIZE[MT_SIZE.index("--encoder-attention-heads") + 1]
    assert (f"encoder: {heads} heads, post-norm layers; decoder: {heads} heads, post-norm layers; activation relu; "
            "encoder sinusoidal positions, decoder sinusoidal positions") in proc.stdout + proc.stderr
    started = torch.load(tmp_path / "run" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert started["optimizer_history"][-1]["num_updates"] == 2
    out = tmp_path / "lion_d.pt"
    assert main([str(transformer), str(out), "--arch", "lion_d_transformer_tiny", "--data", str(mt_data)]) == 0
    hub = LionTransformerModel.from_pretrained(str(tmp_path), out.name, str(mt_data))
    teacher = state_of(transformer)
    assert all(torch.equal(hub.models[0].state_dict()[k], v) for k, v in teacher.items())
    assert len(hub.translate("w1 w2 w3", beam=2).split()) > 0
    # a teacher trained with fairseq's IWSLT recipe's --eval-bleu --eval-bleu-detok moses: how it read its data
    # travels, its evaluation during training does not (converting imported sacremoses, not installed here)
    state = torch.load(transformer, map_location="cpu", weights_only=False)
    state["cfg"]["task"].update(eval_bleu=True, eval_bleu_detok="moses", left_pad_source=False)
    torch.save(state, tmp_path / "bleu_teacher.pt")
    assert main([str(tmp_path / "bleu_teacher.pt"), str(out), "--arch", "lion_d_transformer_tiny", "--data",
                 str(mt_data)]) == 0
    task = torch.load(out, weights_only=False)["cfg"]["task"]
    assert task["eval_bleu"] is False and task["eval_bleu_detok"] == "space" and task["left_pad_source"] is False


def test_a_teacher_of_another_kind_names_the_arch_that_starts_from_it(roberta, transformer_lm, transformer,
                                                                     text_data_bin, tmp_path):
    """--finetune-from-model with a checkpoint of a kind the arch does not start from (a translation model
    for a causal LM, ...): the first differing tensor would name an option that cannot make it fit; the
    message names the kind and the archs that start from it."""
    from types import SimpleNamespace

    from lion_fairseq.clear_errors import other_kind_message

    cases = [(transformer, "lion_s_lm_tiny", "lion_{lit,d,s}_transformer", "translation"),
             (transformer_lm, "lion_s_transformer_tiny", "lion_{lit,d,s}_lm[_tiny]", "language_modeling"),
             (transformer_lm, "lion_s_tiny", "lion_{lit,d,s}_lm[_tiny]", "language_modeling"),
             (roberta, "lion_d_lm_tiny", "lion_{lit,d,s}[_large|_tiny]", "masked_lm")]
    for checkpoint, arch, pick, task in cases:  # with the task that kind trains under
        message = other_kind_message(str(checkpoint), SimpleNamespace(_name=arch))
        assert message and f"pick an arch of {pick}" in message and f"with --task {task}" in message, (arch, message)
    # a teacher of the arch's own kind, or a LION checkpoint of it, is for the weights to judge
    assert other_kind_message(str(roberta), SimpleNamespace(_name="lion_s_tiny")) is None
    assert other_kind_message(str(transformer_lm), SimpleNamespace(_name="lion_lit_lm")) is None
    # through fairseq-train, where the message is the last line
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", str(text_data_bin), "--user-dir", USER_DIR,
                           *TRAIN, "--arch", "lion_s_tiny", *SIZE, "--max-update", "1", "--save-dir", str(tmp_path),
                           "--finetune-from-model", str(transformer_lm)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0 and "it holds a transformer_lm model" in proc.stderr.strip().splitlines()[-1]


def test_a_task_option_given_after_the_arch_wins_over_the_teachers(roberta, tmp_path, capsys):
    """The teacher's task settings travel to the converted file, except one the user passes after the arch:
    that one is the user's (the teacher's masked_lm trained at the default --mask-prob 0.15)."""
    from lion_fairseq import convert

    teacher = torch.load(roberta, map_location="cpu", weights_only=False)["cfg"]["task"]
    assert teacher["mask_prob"] == 0.15
    out = tmp_path / "lion.pt"
    assert convert.main([str(roberta), str(out), "--arch", "lion_s_tiny", "--mask-prob", "0.3"]) == 0, \
        capsys.readouterr().err
    assert torch.load(out, weights_only=False)["cfg"]["task"]["mask_prob"] == 0.3
