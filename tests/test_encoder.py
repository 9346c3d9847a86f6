"""The LION encoders through fairseq itself: masked-LM training with fairseq-train, checkpoint reload,
form switching, padding, GLUE-style fine-tuning from the MLM checkpoint, the hub interface, gate
gradients and option errors. Tiny models on a small real corpus (pydoc topics), CPU."""
import argparse
import json
import logging
import re
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

import lion_fairseq  # noqa: F401  (registers the models, as --user-dir does in the CLIs)
from conftest import USER_DIR, build_model, corpus_lines, fairseq_cli, training_args

VARIANTS = ("lit", "d", "s")
FORMS = ("parallel", "chunk", "recurrent")
# train each variant in a different form, so every form's backward is used by a real fairseq-train run
TRAIN_FORM = {"lit": "parallel", "d": "chunk", "s": "recurrent"}
TOKENS_PER_SAMPLE = 64
MLM_UPDATES = 30

COMMON = ["--user-dir", USER_DIR, "--cpu", "--num-workers", "0", "--seed", "1", "--optimizer", "adam",
          "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--log-format", "json", "--log-interval", "5",
          "--no-epoch-checkpoints", "--no-progress-bar"]


def _json_records(stdout: str, tag: str) -> List[Dict]:
    """fairseq's ``--log-format json`` records of one kind (``train_inner``, ``valid``)."""
    return [json.loads(m.group(1)) for m in re.finditer(rf"\| {tag} \| (\{{.*\}})", stdout)]


@pytest.fixture(scope="module")
def mlm(text_data_bin, tmp_path_factory):
    """``mlm(variant)`` -> (save_dir, fairseq-train stdout) of a tiny masked-LM run, trained once."""
    runs = {}

    def train(variant: str):
        if variant not in runs:
            save = tmp_path_factory.mktemp(f"mlm_{variant}")
            proc = fairseq_cli(
                "train", str(text_data_bin), *COMMON, "--task", "masked_lm", "--criterion", "masked_lm",
                "--arch", f"lion_{variant}_tiny", "--lion-form", TRAIN_FORM[variant], "--lion-chunk-size", "16",
                "--tokens-per-sample", str(TOKENS_PER_SAMPLE), "--batch-size", "16", "--lr", "0.001",
                "--max-update", str(MLM_UPDATES), "--save-dir", str(save))
            runs[variant] = (save, proc.stdout + proc.stderr)
        return runs[variant]

    return train


def _load(save_dir: Path, file: str = "checkpoint_last.pt", **overrides):
    from fairseq import checkpoint_utils

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(save_dir / file)], arg_overrides=overrides)
    return models[0].eval(), task


def _sentences(task, n: int = 6) -> List[torch.Tensor]:
    """Held-out lines of distinct lengths (several chunks of 8 and a remainder), as masked_lm feeds them:
    ``<s> words </s>``."""
    lines = corpus_lines()[-300:]
    by_len = {}
    for line in lines:
        by_len.setdefault(len(line.split()), line)
    picked = [by_len[k] for k in sorted(by_len)[-n:]] + [by_len[min(by_len)]]
    d = task.source_dictionary
    return [torch.cat([torch.tensor([d.bos()]), d.encode_line(s, add_if_not_exist=False).long()]) for s in picked]


def _right_padded(sents: List[torch.Tensor], pad: int) -> torch.Tensor:
    from fairseq.data import data_utils

    return data_utils.collate_tokens(sents, pad, left_pad=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlm_trains_and_reloads(mlm, variant):
    save, log = mlm(variant)
    losses = [float(r["loss"]) for r in _json_records(log, "train_inner")]
    assert len(losses) >= MLM_UPDATES // 5 - 1, log[-3000:]
    # the first records are near log2(vocab) ~ 11 bits; a learning model is well below after 30 updates
    assert losses[-1] < 0.8 * losses[0], losses
    model, task = _load(save)
    assert type(model).__name__ == "LionRobertaModel"
    assert model.args.lion_variant == variant
    assert (save / "checkpoint_last.pt").exists()


@pytest.mark.parametrize("variant", VARIANTS)
def test_forms_and_padding_agree(mlm, variant):
    """One trained checkpoint, reloaded in each form (as --model-overrides does): the same features,
    and a sentence's features are the same alone as inside a right-padded batch. (Without gradients the
    recurrent form encodes block by block, as inference runs it; test_attention_module runs its scans.)"""
    save, _ = mlm(variant)
    feats = {}
    for form in FORMS:
        model, task = _load(save, lion_form=form, lion_chunk_size=8)
        assert model.encoder.sentence_encoder.layers[0].self_attn.form == form
        sents = _sentences(task)
        pad = task.source_dictionary.pad()
        batch = _right_padded(sents, pad)
        assert batch.eq(pad).any()
        with torch.no_grad():
            batched, _ = model(batch, features_only=True)
            alone = [model(s[None], features_only=True)[0][0] for s in sents]
        for i, s in enumerate(sents):
            assert _rel(batched[i, : len(s)], alone[i]) < 1e-4, (form, i)
        feats[form] = alone
    for form in ("chunk", "recurrent"):
        for a, b in zip(feats[form], feats["parallel"]):
            assert _rel(a, b) < 1e-4, form
    # the check has teeth: a different model gives different features
    other, _ = _load(mlm("s" if variant != "s" else "d")[0], lion_form="parallel")
    with torch.no_grad():
        assert _rel(other(sents[0][None], features_only=True)[0][0], feats["parallel"][0]) > 1e-2


def test_model_overrides_switch_the_form_in_fairseq_validate(mlm, text_data_bin):
    """fairseq-validate --model-overrides "{'lion_form': 'parallel'}" on a checkpoint trained in the
    recurrent form gives the validation loss that training reported (same seeded masks)."""
    save, log = mlm("s")
    trained = float(_json_records(log, "valid")[-1]["valid_loss"])
    proc = fairseq_cli("validate", str(text_data_bin), "--user-dir", USER_DIR, "--cpu", "--num-workers", "0",
                       "--task", "masked_lm", "--tokens-per-sample", str(TOKENS_PER_SAMPLE), "--batch-size", "16",
                       "--path", str(save / "checkpoint_last.pt"), "--model-overrides", "{'lion_form': 'parallel'}")
    out = proc.stdout + proc.stderr
    validated = float(re.search(r"valid on 'valid' subset \| loss ([0-9.]+)", out).group(1))
    assert abs(validated - trained) <= 2e-3, (trained, validated)
    # the log names what ran: training's validation in the recurrent form went block by block
    assert "LION attention: recurrent form at inference, blockwise: blocks of 256 tokens" in log
    assert "LION attention: parallel form, cpu, float32 inputs" in out


@pytest.mark.parametrize("variant", ("d", "s"))
def test_every_gate_parameter_gets_a_gradient(mlm, variant):
    """The masked-LM loss reaches every decay gate parameter in every form, with the same gradient."""
    save, _ = mlm(variant)
    grads = {}
    for form in FORMS:
        model, task = _load(save, lion_form=form, lion_chunk_size=8)
        pad = task.source_dictionary.pad()
        batch = _right_padded(_sentences(task), pad)
        logits, _ = model(batch)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch.reshape(-1), ignore_index=pad)
        loss.backward()
        gates = {n: p for n, p in model.named_parameters() if ".gate_logit" in n or ".gate_proj." in n}
        expected = model.args.encoder_layers * (1 if variant == "d" else 2)
        assert len(gates) == expected, sorted(gates)
        for name, p in gates.items():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            per_head = p.grad.reshape(p.shape[0], -1).abs().sum(-1)  # gate_logit (H,), gate_proj (H, C), (H,)
            assert (per_head > 0).all(), (name, per_head)
        grads[form] = {n: p.grad.clone() for n, p in gates.items()}
    for form in ("chunk", "recurrent"):
        for name, g in grads[form].items():
            assert _rel(g, grads["parallel"][name]) < 1e-3, (form, name)


def test_hub_fill_mask_and_features(mlm, text_data_bin, caplog):
    from lion_fairseq.models.lion_encoder import LionRobertaModel

    save, _ = mlm("s")
    hub = LionRobertaModel.from_pretrained(str(save), "checkpoint_last.pt", str(text_data_bin))
    vocab = len(hub.task.source_dictionary)
    out = hub.fill_mask("the value of the <mask> is returned", topk=5)
    assert len(out) == 5
    # a list of sentences (it said "needs exactly one <mask>; got [...]" of a list with one in each)
    with pytest.raises(ValueError, match="fill_mask takes one sentence .a str. with one <mask>; got a list"):
        hub.fill_mask(["the <mask> is", "a <mask> of"])
    probs = [p for _, p, _ in out]
    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6
    # a trained model is far from uniform over the vocabulary
    assert probs[0] > 10 / vocab, out
    for filled, _, word in out:
        assert word in hub.task.source_dictionary.symbols
        assert filled == f"the value of the {word} is returned"
    # each probability is the model's own for its token, and special symbols fill nothing, with a BPE too:
    # fairseq's hub dropped a </s> ranked first from the tokens only, pairing each token after it with the
    # probability of the rank above (a BPE that is not the whitespace stand-in takes that path)
    d = hub.task.source_dictionary
    boosted = LionRobertaModel.from_pretrained(str(save), "checkpoint_last.pt", str(text_data_bin))
    boosted.model.encoder.lm_head.bias.data[d.eos()] += 10.0  # </s> the model's first choice

    class Words:
        def encode(self, x: str) -> str:
            return " ".join(x.split())

        def decode(self, x: str) -> str:
            return x

    masked = hub.encode("the value of the <mask> is returned")
    at = int((masked == boosted.task.mask_idx).nonzero()[0])
    with torch.no_grad():
        boosted.model.eval()
        prob = boosted.model(masked.unsqueeze(0))[0][0, at].float().softmax(-1)
    assert int(prob.argmax()) == d.eos()
    for bpe in (boosted.bpe, Words()):
        boosted.bpe = bpe
        out = boosted.fill_mask("the value of the <mask> is returned", topk=5)
        assert len(out) == 5 and all(d.index(word.strip()) >= d.nspecial for _, _, word in out), out
        assert [p for _, p, _ in out] == pytest.approx([float(prob[d.index(w.strip())]) for _, _, w in out], rel=1e-5)
    tokens = hub.encode("the value of the object is returned")
    assert tokens[0] == hub.task.source_dictionary.bos() and len(tokens) == 9
    # fairseq's hub starts in train mode (dropout on), as RoBERTa's does: outputs vary, and it says so, once
    with caplog.at_level(logging.WARNING):
        assert hub.extract_features(tokens).shape == (1, 9, 128)
        assert not torch.equal(hub.extract_features(tokens), hub.extract_features(tokens))
    assert caplog.text.count("the hub is in training mode") == 1 and "hub.eval()" in caplog.text, caplog.text
    hub.eval()
    layers = hub.extract_features(tokens, return_all_hiddens=True)  # the embeddings and each layer's output
    assert len(layers) == 3 and torch.equal(layers[-1], hub.extract_features(tokens))
    hub.train()
    # no positions: LION-S encodes far past its training length (64), in a form without an L x L matrix
    long = torch.cat([tokens[:-1]] * 40 + [tokens[-1:]])
    hub_chunk = LionRobertaModel.from_pretrained(str(save), "checkpoint_last.pt", str(text_data_bin),
                                                 lion_form="chunk")
    with torch.no_grad():
        feats = hub_chunk.extract_features(long)
    assert feats.shape == (1, len(long), 128) and torch.isfinite(feats).all()
    # learned positions (LIT) stop at the trained length, saying what to do
    lit = LionRobertaModel.from_pretrained(str(mlm("lit")[0]), "checkpoint_last.pt", str(text_data_bin))
    with pytest.raises(ValueError, match=r"321 tokens exceeds the 64 learned positions.*--lion-positions none"):
        lit.extract_features(long)
    lit.register_classification_head("head", num_classes=2)
    with pytest.raises(ValueError, match=r"321 tokens exceeds the 64 learned positions"):
        lit.predict("head", long)
    lit.bpe = Words()  # the hub's advice, not the command line's
    with pytest.raises(ValueError, match=r"66 tokens exceeds the 64 learned positions.*use a shorter input"):
        lit.fill_mask(" ".join(["the"] * 63) + " <mask>")


def test_sentence_prediction_finetunes_from_mlm(mlm, text_data_bin, labelled_data_bin, tmp_path):
    from lion_fairseq.models.lion_encoder import LionRobertaModel

    mlm_save, _ = mlm("s")
    data = labelled_data_bin
    valid_labels = (data.parent / "valid.label").read_text().split()
    chance = max(valid_labels.count("0"), valid_labels.count("1")) / len(valid_labels)
    save = tmp_path / "ft"
    proc = fairseq_cli(
        "train", str(data), *COMMON, "--task", "sentence_prediction", "--criterion", "sentence_prediction",
        "--arch", "lion_s_tiny", "--num-classes", "2", "--init-token", "0", "--separator-token", "2",
        "--max-positions", str(TOKENS_PER_SAMPLE), "--lion-form", "chunk", "--lion-chunk-size", "16",
        "--restore-file", str(mlm_save / "checkpoint_last.pt"), "--reset-optimizer", "--reset-dataloader",
        "--reset-meters", "--batch-size", "32", "--lr", "0.001", "--max-update", "25",
        "--best-checkpoint-metric", "accuracy", "--maximize-best-checkpoint-metric", "--save-dir", str(save))
    log = proc.stdout + proc.stderr
    assert "Loaded checkpoint" in log and str(mlm_save) in log
    accuracy = [float(r["valid_accuracy"]) / 100 for r in _json_records(log, "valid")]
    assert accuracy and accuracy[-1] > chance + 0.1, (accuracy, chance)

    hub = LionRobertaModel.from_pretrained(str(save), "checkpoint_last.pt", str(data))
    assert "sentence_classification_head" in hub.model.classification_heads
    logp = hub.predict("sentence_classification_head", hub.encode("the object is returned"))
    assert logp.shape == (1, 2) and torch.allclose(logp.exp().sum(), torch.tensor(1.0))
    with pytest.raises(KeyError, match=r"no classification head 'sentence_classification'.*"
                                       r"\['sentence_classification_head'\].*register_classification_head"):
        hub.predict("sentence_classification", hub.encode("the object is returned"))
    # --load-checkpoint-heads keeps the checkpoint's head, which a head of other classes cannot take: the
    # error names both counts (it blamed the arch, which was right)
    with pytest.raises(ValueError, match=r"head 'sentence_classification_head' has 2 classes and this run's has 3 "
                                         r"\(--num-classes\): .*pass --num-classes 2, or leave --load-checkpoint-heads"):
        _load(save, num_classes=3, load_checkpoint_heads=True)
    # the pretraining data folder: the task reads input0/dict.txt, and the message names that file
    with pytest.raises(FileNotFoundError, match=r"has no input0/dict\.txt"):
        LionRobertaModel.from_pretrained(str(save), "checkpoint_last.pt", str(text_data_bin))


@pytest.mark.parametrize("bad, message", [
    (["--lion-form", "fft"], r"--lion-form.*invalid choice: 'fft'"),  # refused by fairseq's argument parser
    (["--lion-chunk-size", "0"], r"--lion-chunk-size must be an integer >= 1"),  # by the model as it is built
])
def test_bad_options_stop_with_the_option_named(text_data_bin, tmp_path, bad, message):
    with pytest.raises(AssertionError, match=message):
        fairseq_cli("train", str(text_data_bin), *COMMON, "--task", "masked_lm", "--criterion", "masked_lm",
                    "--arch", "lion_d_tiny", "--batch-size", "4", "--max-update", "1", "--save-dir", str(tmp_path), *bad)
    assert not list(tmp_path.glob("*.pt"))


@pytest.mark.parametrize("bad, message", [
    (["--lion-feature-map", "identity"], r"--lion-feature-map identity .*--no-lion-normalize"),
    # the tiny arch's 2 heads at another width are fine; lion_d's 12 at a tiny width are not
    (["--arch", "lion_d", "--encoder-layers", "2", "--encoder-embed-dim", "128", "--encoder-ffn-embed-dim", "256"],
     r"--encoder-embed-dim 128 must be divisible by --encoder-attention-heads 12"),
])
def test_bad_model_options_are_named(text_data_bin, bad, message):
    """More options the model refuses as fairseq-train builds it (which then stops, as above)."""
    with pytest.raises(ValueError, match=message):
        build_model(text_data_bin, "masked_lm", "--arch", "lion_d_tiny", *bad)


def test_embedding_and_final_norm_options_build_what_they_name(text_data_bin):
    """--no-layernorm-embedding drops the embeddings' norm; --encoder-normalize-before ends the encoder in a
    LayerNorm (at initialisation each token's features then have mean 0 and variance 1)."""
    plain = build_model(text_data_bin, "masked_lm", "--arch", "lion_s_tiny")[1].encoder.sentence_encoder
    assert plain.layernorm_embedding is not None
    bare = build_model(text_data_bin, "masked_lm", "--arch", "lion_s_tiny", "--no-layernorm-embedding")[1]
    assert bare.encoder.sentence_encoder.layernorm_embedding is None
    pre = build_model(text_data_bin, "masked_lm", "--arch", "lion_s_tiny", "--encoder-normalize-before")[1].eval()
    with torch.no_grad():
        features = pre(torch.randint(4, 100, (2, 12)), features_only=True)[0]
    torch.testing.assert_close(features.mean(-1), torch.zeros(2, 12), atol=1e-5, rtol=0)
    torch.testing.assert_close(features.var(-1, unbiased=False), torch.ones(2, 12), atol=1e-3, rtol=0)


@pytest.mark.parametrize("task, arch, bad, message", [
    ("masked_lm", "lion_s_tiny", ["--mha-heads-to-keep", "2"], "structured pruning of softmax heads"),
    ("language_modeling", "lion_s_lm_tiny", ["--decoder-learned-pos"], "pass --lion-positions learned"),
    ("language_modeling", "lion_d_lm_tiny", ["--adaptive-softmax-cutoff", "100,200"], "no adaptive input or softmax"),
    ("translation", "lion_s_transformer_tiny", ["--relu-dropout", "0.1"], "pass that"),
    ("translation", "lion_d_transformer_tiny", ["--no-cross-attention"], "always attends to the source"),
])
def test_options_of_softmax_models_name_what_to_pass(text_data_bin, capsys, task, arch, bad, message):
    """An option of fairseq's softmax model that the LION model has not stops fairseq-train's parser with
    what to pass instead (argparse said only "unrecognized arguments"); unset, it adds nothing to the config."""
    with pytest.raises(SystemExit):
        training_args(text_data_bin, task, "--arch", arch, *bad)
    err = capsys.readouterr().err
    assert f"error: {bad[0]}: " in err and message in err, err
    assert bad[0][2:].replace("-", "_") not in vars(training_args(text_data_bin, task, "--arch", arch))


@pytest.mark.parametrize("task, softmax_arch, arch", [("masked_lm", "roberta_base", "lion_s_tiny"),
                                                       ("language_modeling", "transformer_lm", "lion_s_lm_tiny"),
                                                       ("translation", "transformer", "lion_s_transformer_tiny")])
def test_every_option_of_the_softmax_model_is_taken_or_refused(text_data_bin, task, softmax_arch, arch):
    """Every option of the fairseq model a LION model stands beside is on the LION model's fairseq-train
    command line: as an option of its own (or of the task), or refused naming what to pass instead. None is
    argparse's bare "unrecognized arguments" to a user who carries a command over."""
    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    softmax = argparse.ArgumentParser()
    ARCH_MODEL_REGISTRY[softmax_arch].add_args(softmax)
    parser = options.get_training_parser()
    training_args(text_data_bin, task, "--arch", arch, parser=parser)
    taken = parser._option_string_actions
    assert sorted(o for o in softmax._option_string_actions if o not in taken) == []



@pytest.mark.parametrize("arch", ["lion_lit_tiny", "lion_s_tiny"])
def test_sentence_prediction_without_max_positions_takes_the_tasks_as_roberta_does(labelled_data_bin, arch):
    # the arch once set the shared --max-positions to None, and fairseq-train stopped in hydra's
    # "task.max_positions is not Optional"
    tiny = ("--encoder-layers", "1", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
            "--encoder-attention-heads", "2")
    built = {a: build_model(labelled_data_bin, "sentence_prediction", "--criterion", "sentence_prediction",
                            "--arch", a, "--num-classes", "2", *(tiny if a == "roberta" else ()))
             for a in ("roberta", arch)}
    (task, model), (_, roberta) = built[arch], built["roberta"]
    assert task.max_positions() == roberta.max_positions() == 512
    learned = model.encoder.sentence_encoder.embed_positions
    assert (learned is not None) == (arch == "lion_lit_tiny")
    if learned is not None:
        assert learned.max_positions == 512


def test_positions_mismatch_is_named_last(mlm, labelled_data_bin, tmp_path):
    """Fine-tuning LION-LIT with --max-positions 512 (the README's value when issue 28 was filed) from an
    MLM trained on 64-token samples: the error names the learned positions and what to pass, and is the
    last thing printed, after fairseq's own 'please ensure that the architectures match'."""
    mlm_save, _ = mlm("lit")
    data = labelled_data_bin
    with pytest.raises(AssertionError) as failed:
        fairseq_cli("train", str(data), *COMMON, "--task", "sentence_prediction", "--criterion",
                    "sentence_prediction", "--arch", "lion_lit_tiny", "--num-classes", "2", "--init-token", "0",
                    "--separator-token", "2", "--max-positions", "512", "--restore-file",
                    str(mlm_save / "checkpoint_last.pt"), "--reset-optimizer", "--reset-dataloader",
                    "--reset-meters", "--batch-size", "8", "--max-update", "1", "--save-dir", str(tmp_path / "ft"))
    last = [line for line in str(failed.value).splitlines() if line.strip()][-1]
    assert "learned positions: the checkpoint has 64 and the model 512; pass --max-positions 64 (in masked_lm " \
           "--tokens-per-sample 64, which sets it)" in last, last
    # and, read from the checkpoint, the arch and sizes to pass in one go (not one option per failed run)
    assert "It was trained as --arch lion_lit_tiny --encoder-layers 2 --encoder-embed-dim 128 " \
           "--encoder-ffn-embed-dim 512 --encoder-attention-heads 2 " in last, last
    assert last.endswith(" --lion-feature-map elu --lion-normalize --lion-positions learned --activation-fn gelu."), \
        last


@pytest.mark.parametrize("pretrained", [
    ["--arch", "lion_s_tiny", "--lion-feature-map", "elu"],
    ["--arch", "lion_lit_tiny", "--lion-feature-map", "identity", "--no-lion-normalize", "--lion-norm-after",
     "--encoder-normalize-before", "--lion-positions", "none"],
    ["--arch", "lion_d_tiny", "--encoder-layers", "3", "--lion-short-conv", "3", "--lion-output-gate",
     "--no-layernorm-embedding"]])
def test_trained_as_options_rebuild_the_model(pretrained, tmp_path):
    """``check_checkpoint --options`` (what glue/finetune.sh fine-tunes with): parsed again, they give the
    model config the checkpoint holds, in sizes, layer structure and every option its weights were trained
    with. They gave only the arch and sizes, so the recipe fine-tuned a checkpoint pretrained with
    ``--lion-feature-map elu`` as silu_norm (logged, and trained on)."""
    import shlex

    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from lion_fairseq.clear_errors import FIXED_BY_TRAINING, trained_as_options
    from lion_fairseq.models.lion_options import built_value

    def model_cfg(argv):
        return convert_namespace_to_omegaconf(training_args(tmp_path, "masked_lm", *argv)).model

    trained = model_cfg(pretrained)
    rebuilt = model_cfg(shlex.split(trained_as_options(trained)))
    for key in (*FIXED_BY_TRAINING, "encoder_layers", "encoder_embed_dim", "encoder_normalize_before",
                "layernorm_embedding", "activation_fn"):
        assert built_value(rebuilt, key) == built_value(trained, key), key
    # a checkpoint file holds a plain dict: the same options
    from omegaconf import OmegaConf

    assert trained_as_options(OmegaConf.to_container(trained)) == trained_as_options(trained)


def test_missing_restore_file_with_resets_is_refused(mlm, labelled_data_bin, tmp_path):
    """The README's fine-tuning command with a mistyped --restore-file: fairseq logged 'No existing
    checkpoint found' and fine-tuned a randomly initialised encoder; now it stops, naming the path."""
    mlm_save, _ = mlm("s")
    data = labelled_data_bin
    typo = mlm_save.parent / (mlm_save.name + "x") / "checkpoint_last.pt"
    with pytest.raises(AssertionError) as failed:
        fairseq_cli("train", str(data), *COMMON, "--task", "sentence_prediction", "--criterion",
                    "sentence_prediction", "--arch", "lion_s_tiny", "--num-classes", "2", "--init-token", "0",
                    "--separator-token", "2", "--max-positions", "64", "--restore-file", str(typo),
                    "--reset-optimizer", "--reset-dataloader", "--reset-meters", "--batch-size", "8",
                    "--max-update", "1", "--save-dir", str(tmp_path / "ft"))
    assert f"--restore-file {typo} does not exist. With --reset-optimizer --reset-meters --reset-dataloader" in str(
        failed.value)
    assert not (tmp_path / "ft").exists() or not list((tmp_path / "ft").glob("*.pt"))


def test_missing_restore_file_of_another_name_is_refused(text_data_bin, tmp_path):
    """A --restore-file that does not exist, without --reset-*: fairseq would train from random weights (and
    save over <save-dir>'s checkpoints); a name other than checkpoint_last.pt (which a resumable run's first
    launch may name) is a wrong path, and stops the run before it writes anything."""
    from lion_fairseq.clear_errors import missing_restore_file_message

    missing = tmp_path / "pretrained" / "checkpoint_best.pt"
    with pytest.raises(AssertionError) as failed:
        fairseq_cli("train", str(text_data_bin), *COMMON, "--task", "masked_lm", "--criterion", "masked_lm",
                    "--arch", "lion_s_tiny", "--tokens-per-sample", "32", "--batch-size", "8", "--max-update", "1",
                    "--save-dir", str(tmp_path / "run"), "--restore-file", str(missing))
    assert f"--restore-file {missing} does not exist, and fairseq would train from random weights" in str(failed.value)
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("*.pt"))

    class Cfg:
        restore_file = str(tmp_path / "run" / "checkpoint_last.pt")
    assert missing_restore_file_message(Cfg.restore_file, Cfg) is None  # a first launch, spelled as a path
    Cfg.restore_file = str(tmp_path)  # the save dir, not a file in it
    assert "is a folder" in missing_restore_file_message(Cfg.restore_file, Cfg)
    # a name relative to --save-dir, where fairseq reads it from the current folder: the file that exists is named
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "checkpoint_1_5.pt").write_bytes(b"")
    Cfg.restore_file, Cfg.save_dir = "checkpoint_1_5.pt", str(tmp_path / "run")
    assert (f"does not exist (a relative path is read from the current folder, not --save-dir: pass --restore-file "
            f"{tmp_path / 'run' / 'checkpoint_1_5.pt'}, which exists)") in missing_restore_file_message(
                Cfg.restore_file, Cfg)
    # fairseq adds --checkpoint-suffix to --restore-file's name too: the file typed exists, the one read does not
    Cfg.restore_file, Cfg.checkpoint_suffix = str(tmp_path / "run" / "checkpoint_1_5.pt"), "_b"
    assert (f"--restore-file {Cfg.restore_file} is read as {tmp_path / 'run' / 'checkpoint_1_5_b.pt'}, which does not "
            "exist: fairseq adds --checkpoint-suffix _b to that name too") in missing_restore_file_message(
                str(tmp_path / "run" / "checkpoint_1_5_b.pt"), Cfg)


def test_finetune_from_a_folder_or_from_the_save_dir_is_refused(text_data_bin, tmp_path):
    """--finetune-from-model naming a folder trained from random weights (fairseq took the folder for a
    file, then found no checkpoint in it); naming checkpoint_best.pt in the --save-dir of the fine-tuning run
    (fairseq's default `checkpoints` for both) resumed the pretraining run instead and saved over the file."""
    run = [str(text_data_bin), *COMMON, "--task", "masked_lm", "--criterion", "masked_lm", "--arch", "lion_s_tiny",
           "--tokens-per-sample", "32", "--batch-size", "8", "--max-update", "1"]
    fairseq_cli("train", *run, "--save-dir", str(tmp_path / "run"))
    pretrained = tmp_path / "run" / "checkpoint_best.pt"
    before = pretrained.read_bytes()
    for given, save_dir, said in ((tmp_path / "run", tmp_path / "new", f"--finetune-from-model {tmp_path / 'run'} "
                                   "is a folder, and fairseq would train from random weights instead"),
                                  (pretrained, tmp_path / "run", f"--finetune-from-model {pretrained} lies in "
                                   f"--save-dir {tmp_path / 'run'}, under a name this run writes: it would save over "
                                   f"it; and fairseq resumes {tmp_path / 'run' / 'checkpoint_last.pt'} instead")):
        with pytest.raises(AssertionError) as failed:
            fairseq_cli("train", *run[:-1], "3", "--save-dir", str(save_dir), "--finetune-from-model", str(given))
        assert said in str(failed.value)
    assert pretrained.read_bytes() == before and not list((tmp_path / "new").glob("*.pt"))
    # a name fairseq-train writes, with --checkpoint-suffix too; another file in --save-dir is the user's to give
    from argparse import Namespace

    from lion_fairseq.clear_errors import finetune_in_save_dir_message

    for name, suffix, refused in (("checkpoint_best_v2.pt", "_v2", True), ("checkpoint_best-shard0.pt", "", True),
                                  ("checkpoint3.pt", "", True), ("checkpoint_best-pretrained.pt", "", False),
                                  ("checkpoint_best.pt", "_v2", False), ("lion.pt", "", False)):
        cfg = Namespace(finetune_from_model=str(tmp_path / "new" / name), save_dir=str(tmp_path / "new"),
                        checkpoint_suffix=suffix)
        assert (finetune_in_save_dir_message(cfg) is not None) == refused, name


def test_first_difference_names_variant_sizes_and_levers(text_data_bin):
    from lion_fairseq.clear_errors import first_difference

    def weights(*args):
        return build_model(text_data_bin, "masked_lm", "--tokens-per-sample", "64", *args)[1].state_dict()

    base = weights("--arch", "lion_s_tiny")
    assert "LION-D and the model LION-S" in first_difference(weights("--arch", "lion_d_tiny"), base)
    assert "pass --encoder-layers 3" in first_difference(weights("--arch", "lion_s_tiny", "--encoder-layers", "3"), base)
    assert "--encoder-ffn-embed-dim 256" in first_difference(
        weights("--arch", "lion_s_tiny", "--encoder-ffn-embed-dim", "256"), base)
    # a flag says which way to set it (it said "set --lion-norm-after as the checkpoint has it", of a False)
    gate = weights("--arch", "lion_s_tiny", "--lion-output-gate")
    assert first_difference(gate, base).endswith("was trained with it and the model is built without it; pass "
                                                 "--lion-output-gate")
    assert first_difference(base, weights("--arch", "lion_s_tiny", "--lion-norm-after")).endswith(
        "trained without it and the model is built with it; leave out --lion-norm-after")
    assert first_difference(weights("--arch", "lion_s_tiny", "--lion-short-conv", "3"), base).endswith(
        "the checkpoint has 3 and the model 0; pass --lion-short-conv 3")
    assert "--lion-positions learned" in first_difference(
        weights("--arch", "lion_s_tiny", "--lion-positions", "learned"), base)
    # LION-LIT's weights (learned positions, its default) into LION-S: the arch, whose default positions follow,
    # not --lion-positions, which would only lead to the next refusal
    assert "LION-LIT and the model LION-S; pass an --arch of LION-LIT" in first_difference(
        weights("--arch", "lion_lit_tiny"), base)
    assert first_difference(base, weights("--arch", "lion_s_tiny")) is None


def test_layerdrop_pruning_keeps_the_layers_named(mlm, tmp_path):
    """``--encoder-layers-to-keep`` (fairseq's LayerDrop pruning, as RoBERTa has it) on load gives the model of
    the kept layers with their trained weights; it was refused by fairseq-train and dropped on load, every layer
    running."""
    save, _ = mlm("s")
    full, _ = _load(save)
    pruned, _ = _load(save, encoder_layers_to_keep="1")
    assert len(pruned.encoder.sentence_encoder.layers) == 1 and pruned.args.encoder_layers == 1
    kept = full.encoder.sentence_encoder.layers[1].state_dict()
    for name, tensor in pruned.encoder.sentence_encoder.layers[0].state_dict().items():
        assert torch.equal(tensor, kept[name]), name
    # a checkpoint saved before the option existed: fairseq drops a key its config has not, so it is refused
    state = torch.load(save / "checkpoint_last.pt", weights_only=False)
    del state["cfg"]["model"]["encoder_layers_to_keep"]
    torch.save(state, tmp_path / "older.pt")
    assert len(_load(tmp_path, "older.pt")[0].encoder.sentence_encoder.layers) == 2
    with pytest.raises(ValueError, match=r"'encoder_layers_to_keep' \(an option of this model that its config, saved "
                                         r"before the option existed, has not: .*--restore-file"):
        _load(tmp_path, "older.pt", encoder_layers_to_keep="1")


def test_untied_weights_are_not_tied_on_load(mlm, tmp_path):
    """Weights trained with ``--untie-weights-roberta`` loaded into a tied model (the flag left out of a
    fine-tuning run) are refused naming the flag: the tied model's one tensor would silently take the LM
    head's weights in place of the token embeddings."""
    save, _ = mlm("s")
    state = torch.load(save / "checkpoint_last.pt", weights_only=False)
    state["cfg"]["model"]["untie_weights_roberta"] = True
    head, embed = "encoder.lm_head.weight", "encoder.sentence_encoder.embed_tokens.weight"
    state["model"][head] = state["model"][head] + 0.01
    torch.save(state, tmp_path / "untied.pt")
    model, _ = _load(tmp_path, "untied.pt")
    assert torch.equal(model.encoder.lm_head.weight, state["model"][head])
    assert torch.equal(model.encoder.sentence_encoder.embed_tokens.weight, state["model"][embed])
    with pytest.raises(ValueError, match=r"trained with --untie-weights-roberta .*: pass --untie-weights-roberta"):
        _load(tmp_path, "untied.pt", untie_weights_roberta=False)


def test_spectral_norm_head_reloads(mlm, tmp_path):
    """A ``--spectral-norm-classification-head`` head keeps its weight as ``out_proj.weight_orig``, where
    RoBERTa's head check reads ``out_proj.weight``: its checkpoint failed to reload (KeyError), in the hub,
    fairseq-validate and a resumed run alike. Now it reloads and classifies as before."""
    save, _ = mlm("s")
    model, task = _load(save, spectral_norm_classification_head=True)
    model.register_classification_head("sn", num_classes=3)
    model.eval()
    state = torch.load(save / "checkpoint_last.pt", weights_only=False)
    state["cfg"]["model"]["spectral_norm_classification_head"] = True
    state["model"] = model.state_dict()
    assert "classification_heads.sn.out_proj.weight_orig" in state["model"]
    torch.save(state, tmp_path / "sn.pt")
    again, _ = _load(tmp_path, "sn.pt", load_checkpoint_heads=True)  # as the hub loads
    tokens = _sentences(task, 1)[0][None]
    with torch.no_grad():
        assert torch.equal(again(tokens, classification_head_name="sn")[0],
                           model(tokens, classification_head_name="sn")[0])


def test_hub_classes_import_from_the_package():
    """``from lion_fairseq import LionRobertaModel`` as a user writes it after the README (issue 28)."""
    from lion_fairseq import LionLanguageModel, LionRobertaModel, LionTransformerModel

    assert all(hasattr(c, "from_pretrained") for c in (LionLanguageModel, LionRobertaModel, LionTransformerModel))


def test_first_difference_of_an_encoders_positions_and_variant_is_said_in_its_terms(text_data_bin):
    """An encoder's positions: 'no positions' (not a translation model's 'no learned positions' and fairseq's
    --encoder-learned-pos, which masked_lm has not), and the variant's archs include the LRA ones."""
    from lion_fairseq.clear_errors import first_difference

    def weights(*args):
        return build_model(text_data_bin, "masked_lm", "--tokens-per-sample", "64", *args)[1].state_dict()

    base, learned = weights("--arch", "lion_s_tiny"), weights("--arch", "lion_s_tiny", "--lion-positions", "learned")
    assert first_difference(learned, base) == ("positions: the checkpoint has 64 learned positions and the model "
                                               "no positions; pass --lion-positions learned")
    assert first_difference(base, learned) == ("positions: the checkpoint has no positions and the model 64 learned "
                                               "positions; pass --lion-positions none")
    assert "(lion_lit, lion_lit_lm, lion_lit_transformer or lion_lit_lra_<task>, with the size" in first_difference(
        weights("--arch", "lion_lit_tiny"), base)
    # a language model's decoder alone is no translation model: its positions are said as an encoder's
    def lm(*args):
        return build_model(text_data_bin, "language_modeling", "--tokens-per-sample", "64", "--arch",
                           "lion_s_lm_tiny", *args)[1].state_dict()

    assert first_difference(lm("--lion-positions", "learned"), lm()) == (
        "positions: the checkpoint has 64 learned positions and the model no positions; pass --lion-positions learned")
