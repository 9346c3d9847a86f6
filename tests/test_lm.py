"""The causal LION language model through fairseq itself: training, fairseq-eval-lm in every form,
beam search and sampling with recurrent decoding, constant-size decoding state, exact resume."""
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import lion_fairseq  # noqa: F401  (registers the models in this process, as --user-dir does in the CLIs)
from conftest import USER_DIR, build_model, preprocess

TRAIN = ["--task", "language_modeling", "--arch", "lion_s_lm_tiny", "--tokens-per-sample", "64",
         "--batch-size", "16", "--optimizer", "adam", "--lr", "0.003", "--lr-scheduler", "inverse_sqrt",
         "--warmup-updates", "5", "--criterion", "cross_entropy", "--dropout", "0.1", "--seed", "3",
         "--num-workers", "0", "--disable-validation", "--no-epoch-checkpoints", "--save-interval-updates", "15",
         "--log-format", "json", "--log-interval", "5", "--lion-chunk-size", "16"]
UPDATES, HALF = 30, 15  # an epoch of this corpus is ~80 updates: stopping at HALF is mid-epoch


def fairseq_cli(module, *args, stdin=None):
    """``python -m fairseq_cli.<module>`` on one thread: these tiny models gain nothing from a second one, and
    on a busy 2-core machine its OpenMP spin-waits cost several times the work (measured: 0.09 s of CPU per
    update on one thread, 0.3-2 s on two)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", f"fairseq_cli.{module}", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"fairseq_cli.{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# fairseq-train on one thread: on a busy 2-core machine a second thread makes it several times slower
pytestmark = pytest.mark.usefixtures("one_thread")


def train(data, save_dir, max_update, *extra):
    """``extra`` options come after TRAIN's and override them (argparse keeps the last)."""
    return fairseq_cli("train", str(data), "--user-dir", USER_DIR, *TRAIN, "--save-dir", str(save_dir),
                       "--max-update", str(max_update), *extra)


@pytest.fixture(scope="session")
def trained(text_data_bin, tmp_path_factory):
    """(checkpoint path, fairseq-train log) of a tiny LION-S LM trained for UPDATES updates."""
    save = tmp_path_factory.mktemp("lm_ckpt")
    proc = train(text_data_bin, save, UPDATES)
    return save / "checkpoint_last.pt", proc.stdout + proc.stderr


def load_hub(ckpt, data, **overrides):
    from fairseq.hub_utils import GeneratorHubInterface, from_pretrained

    x = from_pretrained(str(ckpt.parent), ckpt.name, str(data), **overrides)
    return GeneratorHubInterface(x["args"], x["task"], x["models"]).eval()


def build(data, *args):
    """(task, model) built the way fairseq-train builds them, untrained, in eval mode."""
    task, model = build_model(data, "language_modeling", "--tokens-per-sample", "64", *args)
    return task, model.eval()


def set_form(model, form):
    for m in model.modules():
        if hasattr(m, "form") and hasattr(m, "chunk_size"):
            m.form = form


def test_training_loss_falls(trained):
    ckpt, log = trained
    losses = [float(json.loads(line[line.index("{"):])["loss"])
              for line in log.splitlines() if "| train_inner |" in line]
    assert len(losses) == UPDATES // 5
    # an untrained model is near log2(vocab) ~ 11 bits; a few dozen updates must take off several
    assert losses[0] > 9.0 and losses[-1] < losses[0] - 2.0, losses
    # the checkpoint reloads under torch's weights_only default (dataclass config, no Namespace)
    state = torch.load(ckpt, weights_only=True)
    assert state["cfg"]["model"]["_name"] == "lion_s_lm_tiny"
    # the log says what ran: form, chunk size (--lion-chunk-size 16) and the chunk form's backend
    assert "LION attention: chunk form (chunks of 16) on torch, cpu, float32 inputs" in log


EVAL = ["--gen-subset", "valid", "--tokens-per-sample", "64", "--batch-size", "8", "--num-workers", "0"]


def eval_lm_in_process(data, ckpt, *args):
    """fairseq-eval-lm's own main() in this process (no interpreter start-up): its loss in bits, unrounded."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli.eval_lm import main

    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--user-dir", USER_DIR, "--path", str(ckpt), *EVAL, *args])
    return main(convert_namespace_to_omegaconf(args))["loss"]


def test_eval_lm_same_loss_in_every_form(trained, text_data_bin):
    ckpt, _ = trained
    # chunk size 8 (trained with 16): several chunk borders inside each 64-token block
    losses = {form: eval_lm_in_process(text_data_bin, ckpt, "--model-overrides",
                                       str({"lion_form": form, "lion_chunk_size": 8}))
              for form in ("parallel", "chunk", "recurrent")}
    assert 3.0 < losses["parallel"] < 9.0
    for form, loss in losses.items():
        assert abs(loss - losses["parallel"]) < 1e-5 * losses["parallel"], losses
    # the console command prints the same number for the recurrent form
    out = fairseq_cli("eval_lm", str(text_data_bin), "--user-dir", USER_DIR, "--path", str(ckpt), *EVAL,
                      "--model-overrides", "{'lion_form': 'recurrent'}")
    printed = re.search(r"Loss \(base 2\): ([0-9.]+)", out.stdout + out.stderr)
    assert printed and printed.group(1) == f"{losses['parallel']:.4f}", (out.stderr[-2000:], losses)
    # long-context scoring (each 16-token stride scored with 48 tokens of context); no learned positions,
    # so nothing is truncated. More context should not make this model worse by much.
    wide = eval_lm_in_process(text_data_bin, ckpt, "--context-window", "48")
    assert 3.0 < wide < losses["parallel"] + 0.5, (wide, losses)
    # one sentence per sample: right-padded batches, and TokenBlockDataset reads np.compat.long (numpy 2 shim)
    per_line = eval_lm_in_process(text_data_bin, ckpt, "--sample-break-mode", "eos")
    assert 3.0 < per_line < 12.0


def test_beam_search_scores_equal_parallel_forward(trained, text_data_bin):
    """Beam 4 with prompts through fairseq's SequenceGenerator (recurrent decoding, beams reordered,
    batch shrinking as sentences finish): every hypothesis' positional scores equal the log-probs of one
    parallel-form forward over the same tokens."""
    from fairseq.sequence_generator import SequenceGenerator

    ckpt, _ = trained
    hub = load_hub(ckpt, text_data_bin)
    model = hub.models[0]
    sizes = []
    decoder_reorder = model.decoder.reorder_incremental_state
    model.decoder.reorder_incremental_state = lambda state, order: (sizes.append(len(order)),
                                                                    decoder_reorder(state, order))[1]
    prompts = ["the python language", "a list of items is", "if"]
    hypos = hub.generate([hub.encode(p) for p in prompts], beam=4, max_len_b=24, min_len=2)
    assert isinstance(hub.task.build_generator(hub.models, hub.cfg.generation), SequenceGenerator)
    assert sizes and sizes[0] == 4 * len(prompts) and min(sizes) < sizes[0], "beams never reordered/shrunk"

    set_form(model, "parallel")
    eos = hub.task.source_dictionary.eos()
    checked = 0
    for prompt, beams in zip(prompts, hypos):
        assert len(beams) == 4
        prompt_tokens = hub.encode(prompt)[:-1]  # encode appends </s>
        for h in beams:
            tokens = h["tokens"]
            assert tokens[:len(prompt_tokens)].tolist() == prompt_tokens.tolist()
            inp = torch.cat([tokens.new_tensor([eos]), tokens[:-1]])[None]
            with torch.no_grad():
                logits, _ = model(inp)
            lprobs = model.get_normalized_probs((logits, None), log_probs=True)[0]
            ref = lprobs.gather(-1, tokens[:, None]).squeeze(-1)
            torch.testing.assert_close(h["positional_scores"], ref, atol=1e-4, rtol=0)
            checked += 1
    assert checked == 4 * len(prompts)


def test_from_pretrained_refuses_another_model_and_a_missing_folder(trained, text_data_bin):
    """A checkpoint of another kind than the class asked is refused naming the class to use (a translation
    hub ran the LM and returned its continuation as the translation); a folder that does not exist is named
    (fairseq raised a TypeError about None)."""
    from lion_fairseq import LionLanguageModel, LionRobertaModel, LionTransformerModel

    ckpt, _ = trained
    for cls in (LionTransformerModel, LionRobertaModel):
        with pytest.raises(TypeError, match="holds a LionLanguageModel .*load it with LionLanguageModel"):
            cls.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin))
    for args in ((str(ckpt.parent / "nope"), ckpt.name, str(text_data_bin)),
                 (str(ckpt.parent), ckpt.name, str(text_data_bin / "nope"))):
        with pytest.raises(FileNotFoundError, match=r"from_pretrained: the (checkpoint's|data) folder .*nope does not"
                           ) as refused:
            LionLanguageModel.from_pretrained(*args)
        assert "starts with '.'" not in str(refused.value)  # that hint is for a "./data" path only
    # fairseq reads a data path that starts with "." inside the checkpoint's folder: so is it checked
    relative = os.path.relpath(text_data_bin, ckpt.parent)
    assert relative.startswith(".") and LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, relative)
    # the data argument left out: the checkpoint's folder has no dict.txt, and the message names the argument
    with pytest.raises(FileNotFoundError, match=r"has no dict\.txt: pass the folder of the data .* third argument"):
        LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name)
    # "./data" meant from the current folder, which fairseq reads inside the checkpoint's: the message says so
    cwd = os.getcwd()
    try:
        os.chdir(text_data_bin.parent)
        with pytest.raises(FileNotFoundError, match=r"inside the checkpoint's folder; from the current folder, pass "
                                                    + re.escape(repr(str(text_data_bin)))):
            LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, "./" + text_data_bin.name)
    finally:
        os.chdir(cwd)
    # the checkpoint file where its folder goes, and a checkpoint name that is not there: what to pass
    with pytest.raises(ValueError, match=re.escape(f"from_pretrained({str(ckpt.parent)!r}, {ckpt.name!r}")):
        LionLanguageModel.from_pretrained(str(ckpt), data_name_or_path=str(text_data_bin))
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint 'model.pt' in .*there: .*{ckpt.name}"):
        LionLanguageModel.from_pretrained(str(ckpt.parent), "model.pt", str(text_data_bin))


def test_hub_sample_and_interactive(trained, text_data_bin):
    ckpt, _ = trained
    hub = load_hub(ckpt, text_data_bin)
    torch.manual_seed(0)
    out = hub.sample(["the python", "a list of"], beam=1, sampling=True, sampling_topk=10, max_len_b=8)
    assert all(o.startswith(p) and len(o.split()) > len(p.split()) for o, p in zip(out, ["the python", "a list of"]))
    # lengths count new tokens, for prompts of different lengths in one call and for prompts longer than
    # the length asked for (fairseq's own hub gave the first 5 words of the long prompt and nothing more)
    from lion_fairseq import LionLanguageModel

    hub = LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin)).eval()
    prompts = ["the python language is a list of items and the value of the object is the name", "if", "a list of"]
    for out in (hub.sample(prompts, beam=1, sampling=True, sampling_topk=10, max_len_b=5, min_len=5),
                [hub.decode(h[0]["tokens"]) for h in hub.generate([hub.encode(p) for p in prompts], beam=3,
                                                                   max_len_b=5, min_len=5)]):
        assert [o.split()[:-5] for o in out] == [p.split() for p in prompts], out
    # a min_len past what max_len_b allows, in those terms (fairseq's assertion counts the prompt in); the
    # default min_len, 1, with max_len_b=0 too
    for lengths, least, most in (({"max_len_b": 3, "min_len": 6}, 6, 3), ({"max_len_b": 0}, 1, 0)):
        with pytest.raises(ValueError, match=rf"^min_len={least} new tokens is more than the {most} that "):
            hub.sample("if", beam=2, **lengths)
    with pytest.raises(ValueError, match=r"^beam=0: the number of hypotheses kept must be an integer >= 1"):
        hub.sample("if", beam=0)  # fairseq: "cannot reshape tensor of 0 elements"

    proc = fairseq_cli("interactive", str(text_data_bin), "--user-dir", USER_DIR, "--task", "language_modeling",
                       "--path", str(ckpt), "--beam", "2", "--max-len-b", "6", "--num-workers", "0",
                       stdin="the python language\na list of\n")
    hyps = [line.split("\t") for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == 2 and hyps[0][2].startswith("the python language") and hyps[1][2].startswith("a list of")


def state_tensors(state):
    """{short key: shape} of every tensor in an incremental_state (keys carry per-module ids)."""
    return {f"{i}:{name}": tuple(t.shape) for i, (key, d) in enumerate(sorted(state.items()))
            for name, t in sorted(d.items())}


@pytest.mark.parametrize("arch,extra", [("lion_lit_lm_tiny", []), ("lion_d_lm_tiny", []), ("lion_s_lm_tiny", []),
                                        ("lion_lit_lm_tiny", ["--layernorm-embedding"])])
def test_prefill_then_steps_equal_full_forward_and_state_is_constant(arch, extra, text_data_bin):
    """A padded batch of prompts prefilled in one call, then decoded token by token the way fairseq's
    generator calls it (whole prefix each step), gives the logits of one full forward over each unpadded
    sentence; the state has the same shapes after 6 or 300 tokens of context."""
    torch.manual_seed(0)
    task, model = build(text_data_bin, "--arch", arch, "--lion-form", "chunk", "--lion-chunk-size", "4",
                        "--max-target-positions", "512", *extra)  # lit's learned positions must reach 300
    if extra:  # not LayerNorm's initial ones and zeros
        torch.nn.init.normal_(model.decoder.layernorm_embedding.weight)
    pad, V = task.source_dictionary.pad(), len(task.source_dictionary)
    sents = [torch.randint(4, V, (n,)) for n in (9, 5, 7)]
    cont = torch.randint(4, V, (3, 4))  # continuation tokens, one column per step
    for side in ("right", "left"):
        prompt = torch.full((3, 9), pad)
        for i, s in enumerate(sents):
            if side == "right":
                prompt[i, :len(s)] = s
            else:
                prompt[i, 9 - len(s):] = s
        state = {}
        with torch.no_grad():
            first = model(prompt, incremental_state=state)[0]  # prefill: (3, 9, V) in one call
            assert first.shape == (3, 9, V)
            prefix, steps = prompt, []
            for t in range(cont.shape[1]):
                prefix = torch.cat([prefix, cont[:, t:t + 1]], 1)
                steps.append(model(prefix, incremental_state=state)[0])
                assert steps[-1].shape == (3, 1, V)  # only the new token is computed
            for i, s in enumerate(sents):
                last = len(s) - 1 if side == "right" else 8
                got = torch.cat([first[i, last:last + 1], *[x[i] for x in steps]])
                ref = model(torch.cat([s, cont[i]])[None])[0][0, len(s) - 1:]
                torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"{side} padding, row {i}")

    # the decoding state does not depend on the context length
    B, H, D = 3, 2, 64
    shapes = []
    for n in (6, 300):
        state = {}
        with torch.no_grad():
            toks = torch.randint(4, V, (B, n))
            model(toks, incremental_state=state)
            model(torch.cat([toks, toks[:, :1]], 1), incremental_state=state)
        shapes.append(state_tensors(state))
    assert shapes[0] == shapes[1], shapes
    assert sum(k.endswith(":S") for k in shapes[0]) == 2  # one (S, z) per layer
    assert all(v == (B, H, D, D) for k, v in shapes[0].items() if k.endswith(":S"))
    assert all(set(v) <= {B, H, D} for v in shapes[0].values()), shapes[0]
    # per layer and head, (S, z) and nothing else: learned positions count the prefix the generator passes
    assert [set(d) for d in state.values()] == [{"S", "z"}] * 2, {key: set(d) for key, d in state.items()}


def test_a_step_given_the_new_token_alone_is_refused_where_positions_need_the_prefix(text_data_bin):
    """Learned positions count the prefix fairseq's generator passes at every step: a caller that passes the
    new token alone would place every step at position 1, silently; a model without positions takes it (its
    state is all it reads), and a decoder without layers has no state to step."""
    torch.manual_seed(0)
    toks = torch.randint(4, 50, (2, 6))
    for arch, refused in (("lion_lit_lm_tiny", True), ("lion_s_lm_tiny", False)):
        _, model = build(text_data_bin, "--arch", arch)
        model.eval()
        with torch.no_grad():
            state = {}
            model(toks[:, :4], incremental_state=state)
            if refused:
                with pytest.raises(ValueError, match="takes the whole prefix, as fairseq's generator passes it"):
                    model(toks[:, 4:5], incremental_state=state)
            else:
                alone = model(toks[:, 4:5], incremental_state=state)[0]
                torch.testing.assert_close(alone[:, -1], model(toks[:, :5])[0][:, -1], atol=1e-5, rtol=1e-5)
    _, model = build(text_data_bin, "--arch", "lion_lit_lm_tiny", "--decoder-layers", "0")
    with torch.no_grad():
        state = {}
        assert model(toks[:, :4], incremental_state=state)[0].shape[:2] == (2, 4)
        assert model(toks[:, :5], incremental_state=state)[0].shape[:2] == (2, 5)  # no state: the whole prefix


def test_options_and_errors(text_data_bin):
    _, model = build(text_data_bin, "--arch", "lion_s_lm_tiny")
    attn = model.decoder.layers[0].self_attn
    assert attn.normalize is True and attn.variant == "s" and attn.causal
    assert model.max_positions() >= 10 ** 9  # no learned positions: no length limit
    _, model = build(text_data_bin, "--arch", "lion_lit_lm_tiny", "--no-lion-normalize",
                     "--lion-feature-map", "identity", "--lion-norm-after", "--lion-form", "parallel")
    attn = model.decoder.layers[0].self_attn
    assert not attn.normalize and attn.head_norm is not None and attn.variant == "lit"
    assert model.max_positions() == 64 and model.decoder.embed_positions is not None
    # one too many, as --add-bos-token makes a 64-token sample: the message names the size that fits it
    with pytest.raises(ValueError, match=r"65 tokens exceeds the 64 learned positions.*--max-target-positions 65 "
                                         r"\(--add-bos-token"):
        model(torch.full((1, 65), 5))
    with pytest.raises(ValueError, match="66 tokens exceeds the 64 learned positions") as longer:
        model(torch.full((1, 66), 5))
    assert "--add-bos-token" not in str(longer.value)
    _, model = build(text_data_bin, "--arch", "lion_lit_lm_tiny", "--add-bos-token", "--max-target-positions", "65")
    assert model.max_positions() == 65 and torch.isfinite(model(torch.full((1, 65), 5))[0]).all()
    with pytest.raises(ValueError, match="--no-lion-normalize"):
        build(text_data_bin, "--arch", "lion_d_lm_tiny", "--lion-feature-map", "identity")
    # --lion-positions overrides the variant's default either way
    assert build(text_data_bin, "--arch", "lion_s_lm_tiny", "--lion-positions", "learned")[1].decoder.embed_positions
    assert build(text_data_bin, "--arch", "lion_lit_lm_tiny", "--lion-positions", "none")[1].decoder.embed_positions is None
    relu = build(text_data_bin, "--arch", "lion_s_lm_tiny", "--activation-fn", "relu")[1]
    assert {layer.activation_fn for layer in relu.decoder.layers} == {torch.nn.functional.relu}


def test_resume_as_another_model_is_refused(lit_trained, text_data_bin, tmp_path):
    """Resuming a run with an option that the weights were trained as changed (the recipe rerun without the
    variable that set it, say) loads without a tensor changing shape: it stops, naming the change, and the
    checkpoint is left as it was. With the --reset-* options (a new run from these weights) it trains, with
    the change logged."""
    import shutil

    shutil.copy(lit_trained, tmp_path / "checkpoint_last.pt")
    before = (tmp_path / "checkpoint_last.pt").read_bytes()
    changed = [str(text_data_bin), "--user-dir", USER_DIR, *TRAIN, "--max-update", "4", "--arch",
               "lion_lit_lm_tiny", "--lion-feature-map", "silu_norm", "--no-lion-normalize", "--activation-fn", "relu",
               "--no-scale-embedding", "--decoder-attention-heads", "4"]
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", *changed, "--save-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "cannot resume" in last, proc.stderr[-3000:]
    assert ("--lion-feature-map elu -> --lion-feature-map silu_norm; --lion-normalize -> --no-lion-normalize; "
            "--activation-fn gelu -> --activation-fn relu; no --no-scale-embedding -> --no-scale-embedding; "
            "--decoder-attention-heads 2 -> --decoder-attention-heads 4") in last
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == before
    resets = ["--reset-optimizer", "--reset-lr-scheduler", "--reset-meters", "--reset-dataloader"]
    # ... and with them in the same --save-dir, the changed model would save over the run's checkpoints
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", *changed, *resets, "--save-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "the changed model would save over that run's checkpoints. Pass a new " \
        "--save-dir" in last, proc.stderr[-3000:]
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == before
    proc = fairseq_cli("train", *changed, *resets, "--save-dir", str(tmp_path / "new"), "--restore-file",
                       str(lit_trained))
    assert "trained as another model than this one: --lion-feature-map elu -> --lion-feature-map silu_norm" \
        in proc.stdout + proc.stderr


def test_resume_with_the_levers_is_exact(text_data_bin, tmp_path):
    """lion_s_lm_plus_tiny (LION-S with a short convolution, output gate, gate temperature), dropout on: a
    run stopped mid-epoch and restarted ends with the same parameters, the levers' own included, as one that
    ran straight through. (A plain LION-S LM killed mid-epoch: test_reliability.py.)"""
    plus = ("--arch", "lion_s_lm_plus_tiny")
    train(text_data_bin, tmp_path / "straight", UPDATES, *plus)
    train(text_data_bin, tmp_path / "resumed", HALF, *plus)
    half = torch.load(tmp_path / "resumed" / "checkpoint_last.pt", weights_only=True)
    assert half["extra_state"]["train_iterator"]["iterations_in_epoch"] == HALF
    train(text_data_bin, tmp_path / "resumed", UPDATES, *plus)
    straight = torch.load(tmp_path / "straight" / "checkpoint_last.pt", weights_only=True)["model"]
    resumed = torch.load(tmp_path / "resumed" / "checkpoint_last.pt", weights_only=True)["model"]
    assert resumed.keys() == straight.keys()
    levers = [n for n in straight if "conv_weight" in n or "out_gate" in n]
    assert levers, sorted(straight)
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    assert not torch.equal(half["model"]["decoder.layers.0.fc1.weight"], straight["decoder.layers.0.fc1.weight"])


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_a_padded_decoding_step_leaves_the_state_unchanged(variant):
    """A decoding step whose token is padding (key_padding_mask True) changes nothing: the next real token
    gives what it gives without the padded step in between; unpadded rows are stepped as usual."""
    from lion_fairseq.modules import LionAttention

    torch.manual_seed(0)
    attn = LionAttention(16, 2, variant, causal=True).eval()
    x = torch.randn(5, 2, 16)

    def decode(steps, masks):
        state = {}
        attn(x[:3], incremental_state=state)  # prefill
        return [attn(x[t:t + 1], key_padding_mask=m, incremental_state=state) for t, m in zip(steps, masks)]

    row0_padded = torch.tensor([[True], [False]])
    with torch.no_grad():
        padded = decode([3, 4], [row0_padded, None])
        skipped = decode([4], [None])
        plain = decode([3, 4], [None, None])
    torch.testing.assert_close(padded[1][:, 0], skipped[0][:, 0])  # row 0: as if the pad never came
    torch.testing.assert_close(padded[1][:, 1], plain[1][:, 1])  # row 1: stepped through token 3
    assert not torch.allclose(skipped[0][:, 0], plain[1][:, 0])  # the check has teeth: token 3 matters


@pytest.mark.parametrize("short_conv", [0, 3])
def test_a_padding_mask_of_another_shape_is_refused(short_conv):
    """A decoding step given the whole prefix's mask read its first column as the new token's and left later
    tokens out of the state, saying nothing; a transposed mask met the convolution as a broadcasting error."""
    from lion_fairseq.modules import LionAttention

    attn = LionAttention(16, 2, "s", causal=True, short_conv=short_conv).eval()
    x = torch.randn(6, 2, 16)
    state = {}
    with torch.no_grad():
        attn(x[:5], incremental_state=state)
        with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, T\) = \(2, 1\).*got \(2, 6\)"):
            attn(x[5:], key_padding_mask=torch.zeros(2, 6, dtype=torch.bool), incremental_state=state)
        with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, T\) = \(2, 6\).*got \(6, 2\)"):
            attn(x, key_padding_mask=torch.zeros(6, 2, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"x must be \(T, B, C\).*got shape \(6, 16\)"):
            attn(x[:, 0])


@pytest.fixture(scope="module")
def lit_trained(text_data_bin, tmp_path_factory):
    """A tiny LION-LIT LM (64 learned positions) trained for 2 updates."""
    save = tmp_path_factory.mktemp("lit_lm_ckpt")
    train(text_data_bin, save, 2, "--arch", "lion_lit_lm_tiny")
    return save / "checkpoint_last.pt"


def test_eval_lm_past_learned_positions_is_refused(text_data_bin, lit_trained):
    """LION-LIT trained with 64 learned positions, scored with --tokens-per-sample 256: fairseq-eval-lm
    would skip every sample longer than 64 with one log line and print a loss over the few left (issue
    28); it stops instead, saying how much would be left out and what to pass. At 64 it scores them all."""
    ckpt = lit_trained
    with pytest.raises(ValueError, match=r"longer than the model's 64 positions.*Pass --tokens-per-sample 64") as e:
        eval_lm_in_process(text_data_bin, ckpt, "--tokens-per-sample", "256")
    covered, total = map(int, re.search(r"cover (\d+) of (\d+) tokens", str(e.value)).groups())
    assert covered < total / 10
    assert 3.0 < eval_lm_in_process(text_data_bin, ckpt) < 20.0
    # the length fairseq's transformer_lm takes as an override adds no learned positions: said, not retrained
    from fairseq import checkpoint_utils

    with pytest.raises(RuntimeError, match=r"learned positions: the checkpoint has 64 and the model 1024; pass "
                                           r"--tokens-per-sample 64, .*no --model-overrides .* adds any"):
        checkpoint_utils.load_model_ensemble([str(ckpt)], arg_overrides={"max_target_positions": 1024})


def test_layerdrop_and_pruning_as_in_transformer_lm(text_data_bin, trained):
    """``--decoder-layerdrop`` and ``--decoder-layers-to-keep`` (fairseq's LayerDrop, as transformer_lm has it;
    both were unrecognized): the layers are fairseq's LayerDropModuleList, and a checkpoint loaded with the
    layers to keep is the model of those layers with their trained weights."""
    from fairseq import checkpoint_utils
    from fairseq.modules import LayerDropModuleList

    _, model = build(text_data_bin, "--arch", "lion_s_lm_tiny", "--decoder-layerdrop", "0.5")
    assert isinstance(model.decoder.layers, LayerDropModuleList) and model.decoder.layers.p == 0.5
    ckpt, _ = trained
    (full,), _ = checkpoint_utils.load_model_ensemble([str(ckpt)])
    (pruned,), _ = checkpoint_utils.load_model_ensemble([str(ckpt)], arg_overrides={"decoder_layers_to_keep": "1"})
    assert len(pruned.decoder.layers) == 1
    kept = full.decoder.layers[1].state_dict()
    for name, tensor in pruned.decoder.layers[0].state_dict().items():
        assert torch.equal(tensor, kept[name]), name


def test_untied_weights_are_not_tied_on_load(trained):
    """A checkpoint trained with separate input and output embeddings, loaded into a model that ties them
    (--share-decoder-input-output-embed added when fine-tuning), is refused naming the option: the shared
    tensor would silently take whichever of the two loads last."""
    from fairseq import checkpoint_utils

    ckpt, _ = trained
    with pytest.raises(ValueError, match=r"this model ties decoder\.embed_tokens\.weight and "
                                         r"decoder\.output_projection\.weight, which differ in the checkpoint: drop "
                                         r"--share-decoder-input-output-embed"):
        checkpoint_utils.load_model_ensemble([str(ckpt)], arg_overrides={"share_decoder_input_output_embed": True})


def test_eval_lm_advice_follows_the_break_mode():
    """--tokens-per-sample bounds the samples of the 'none' break mode only: under eos (one sample a line) the
    advice for lines past the learned positions is the break mode, not the length already passed."""
    from lion_fairseq.clear_errors import over_long_message

    sizes = np.array([10, 270, 20])
    assert "cover 30 of 300 tokens. Pass --tokens-per-sample 64 or less" in over_long_message(sizes, 64, 256)
    eos = over_long_message(sizes, 64, 64, "eos")
    assert "--sample-break-mode eos keeps each line whole whatever --tokens-per-sample: pass --sample-break-mode " \
           "none --tokens-per-sample 64 or less" in eos, eos
    assert over_long_message(np.array([10, 64]), 64, 64, "eos") is None


def test_language_modeling_wrappers_explain_only_their_own_cases(caplog):
    """The plugin's wrappers of fairseq's language_modeling task step in where they have something to say
    and nowhere else: eval-lm stops on over-long samples only where --tokens-per-sample made them (under
    --sample-break-mode eos whole lines are, and it warns, whatever --tokens-per-sample; complete packs lines
    up to it); a model's failure to build is explained only where the model is no causal LM and failed as
    fairseq fails on one."""
    from types import SimpleNamespace

    from fairseq.models import ARCH_MODEL_REGISTRY

    from lion_fairseq.clear_errors import _wrap_eval_lm_dataloader, _wrap_language_model_build

    dataloader = _wrap_eval_lm_dataloader(lambda self, dataset, *args, **kwargs: "batches")
    task = SimpleNamespace(args=SimpleNamespace(tokens_per_sample=64, sample_break_mode="eos"))
    lines = SimpleNamespace(sizes=np.array([10, 70]))
    with caplog.at_level("WARNING"):
        assert dataloader(task, lines, max_positions=64) == "batches"
    assert "1 of 2 samples are longer than the model's 64 positions" in caplog.text
    task.args.tokens_per_sample = 1024  # the same lines: the same outcome
    assert dataloader(task, lines, max_positions=64) == "batches"
    for mode in ("none", "complete"):
        task.args.sample_break_mode = mode
        with pytest.raises(ValueError, match="1 of 2 samples are longer"):
            dataloader(task, lines, max_positions=64)
    # a window of context: the blocks fairseq made (--tokens-per-sample less the window) are not what to pass
    task.args.tokens_per_sample, task.args.sample_break_mode = 112, "none"  # --tokens-per-sample 512, window 400
    with pytest.raises(ValueError, match=r"Pass --tokens-per-sample 64 or less with --context-window below it"):
        dataloader(task, SimpleNamespace(sizes=np.array([112, 112])), max_positions=64, context_window=400)

    def failing(error):
        def build_model(self, cfg, *args, **kwargs):
            raise error
        return _wrap_language_model_build(build_model)

    encoder, lm = SimpleNamespace(_name="lion_s_tiny"), SimpleNamespace(_name="lion_s_lm_tiny")
    assert "lion_s_lm_tiny" in ARCH_MODEL_REGISTRY
    with pytest.raises(ValueError, match="holds a lion_roberta model") as err:
        failing(ValueError("Unsupported language modeling target: future"))(None, encoder)
    assert "language modeling target" in str(err.value.__cause__)
    with pytest.raises(ValueError, match="^the encoder's own failure$"):  # not hidden behind the advice
        failing(ValueError("the encoder's own failure"))(None, encoder)
    for cfg in (lm, SimpleNamespace(_name="transformer_lm")):  # language models: fairseq's error as it is
        with pytest.raises(AttributeError, match="^x$"):
            failing(AttributeError("x"))(None, cfg)


def test_hub_past_learned_positions_says_what_to_do(text_data_bin, lit_trained):
    """The hub's sample() on LION-LIT's 64 learned positions: a longer prompt is refused naming them and
    what to do (fairseq's message named a command-line option the hub has not) or skipped when asked; a
    continuation that would run past them warns how many tokens it stops at (fairseq cut it short
    silently), and gives that many."""
    from lion_fairseq import LionLanguageModel

    hub = LionLanguageModel.from_pretrained(str(lit_trained.parent), lit_trained.name, str(text_data_bin))
    words = " ".join(Path(text_data_bin).parent.joinpath("train.txt").read_text().split()[:80]).split()
    for n in (74, 64, 63):  # 63: prompt and </s> fill the positions, nothing can be added
        with pytest.raises(ValueError, match=rf"a prompt of {n} tokens leaves no room to continue in this model's 64 "
                                             r"learned positions.*at most 62 tokens"):
            hub.sample(" ".join(words[:n]), max_len_b=5)
    assert len(hub.sample([" ".join(words[:63]), " ".join(words[:10])], max_len_b=3,
                          skip_invalid_size_inputs=True)) == 1
    # score() continues nothing: 63 words and </s> fill the 64 positions, with no word of continuing
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*learned positions")
        assert torch.isfinite(hub.score(" ".join(words[:63]))["positional_scores"]).all()
    with pytest.raises(ValueError, match=r"a sequence of 65 tokens exceeds this model's 64 learned positions.*"
                                         r"a shorter text"):
        hub.score(" ".join(words[:64]))
    with pytest.warns(UserWarning, match=r"a prompt of 62 tokens continues by at most 1 tokens, not 5"):
        assert len(hub.sample(" ".join(words[:62]), max_len_b=5, min_len=3).split()) == 63
    with pytest.warns(UserWarning, match=r"a prompt of 61 tokens continues by at most 2 tokens, not 20"):
        tokens = hub.generate(hub.encode(" ".join(words[:61])), beam=1, max_len_b=20, min_len=2)[0]["tokens"]
    eos = hub.task.source_dictionary.eos()
    assert int(tokens.ne(eos).sum()) == 63  # the prompt and 2 new tokens (the last position is for </s>)
    # fairseq-interactive, whose generator stops there too: the log says why the lines end early
    proc = fairseq_cli("interactive", str(text_data_bin), "--user-dir", USER_DIR, "--task", "language_modeling",
                       "--path", str(lit_trained), "--beam", "1", "--max-len-b", "100", "--num-workers", "0",
                       stdin=" ".join(words[:40]) + "\n")
    assert "decoding reached the model's 64 learned positions" in proc.stderr + proc.stdout
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*learned positions")
        hub.generate(hub.encode(" ".join(words[:40])), beam=1, max_len_b=5)
        # fairseq's default max_len_b (200), not asked for, stops at the positions unsaid, as transformer_lm does
        assert len(hub.sample(" ".join(words[:40]), beam=1).split()) <= 63
    # a length asked for at loading is said, as one asked for in the call
    hub = LionLanguageModel.from_pretrained(str(lit_trained.parent), lit_trained.name, str(text_data_bin), max_len_b=30)
    with pytest.warns(UserWarning, match=r"a prompt of 40 tokens continues by at most 23 tokens, not 30"):
        hub.sample(" ".join(words[:40]), beam=1)


def test_max_target_positions_bounds_lion_s_as_it_does_transformer_lm(trained, text_data_bin):
    """LION-S has no positions and so no length limit, unless --max-target-positions sets one, as it does for
    transformer_lm: fairseq then skips the longer samples of a line-by-line split, and the hub's answers name
    the bound and how to go further (the option was ignored before)."""
    from lion_fairseq import LionLanguageModel

    assert build(text_data_bin, "--arch", "lion_s_lm_tiny")[1].max_positions() >= 10 ** 9
    task, model = build(text_data_bin, "--arch", "lion_s_lm_tiny", "--sample-break-mode", "eos",
                        "--max-target-positions", "20")
    assert model.max_positions() == 20
    task.load_dataset("valid")
    data = task.dataset("valid")
    indices = np.arange(len(data))
    kept = task.filter_indices_by_size(indices, data, model.max_positions(), ignore_invalid_inputs=True)
    assert 0 < len(kept) < len(indices) and (data.sizes[kept] <= 20).all()
    ckpt, _ = trained
    hub = LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin), max_target_positions=12)
    with pytest.raises(ValueError, match=r"a prompt of 20 tokens leaves no room to continue in this model's 12 "
                                         r"positions \(its --max-target-positions\).*a larger max_target_positions"):
        hub.sample(" ".join(["the"] * 20), max_len_b=3)


def test_another_data_folder_is_named_as_the_misfit(trained, text_data_bin, tmp_path):
    """Scoring a checkpoint with a data folder of another dictionary: the model's sizes are right and the
    embeddings' rows are not; the message says so and asks for the data folder (it advised the arch and
    size options, and dropping --restore-file)."""
    ckpt, _ = trained
    text = Path(text_data_bin).parent
    preprocess("--only-source", "--trainpref", str(text / "train.txt"), "--testpref", str(text / "test.txt"),
               "--destdir", str(tmp_path), "--nwordssrc", "500", "--workers", "1")
    with pytest.raises(RuntimeError, match=r"differ in the dictionary \(decoder.embed_tokens.weight: the checkpoint "
                                           r"has 2000 rows.*and the model 50\d.*pass the data folder") as e:
        eval_lm_in_process(tmp_path, ckpt)
    assert "--restore-file" not in str(e.value)


def test_eval_lm_context_window_not_below_the_blocks_is_refused(trained, text_data_bin):
    """A --context-window of --tokens-per-sample or more leaves each block nothing to score: fairseq failed
    with "negative dimensions are not allowed" (or a division by zero)."""
    ckpt, _ = trained
    for window, block in (("32", 0), ("40", -8)):
        with pytest.raises(ValueError, match=rf"^blocks of {block} tokens: --tokens-per-sample must be above 0, and in "
                                             "fairseq-eval-lm above --context-window"):
            eval_lm_in_process(text_data_bin, ckpt, "--tokens-per-sample", "32", "--context-window", window)
    assert 3.0 < eval_lm_in_process(text_data_bin, ckpt, "--tokens-per-sample", "32", "--context-window", "24") < 20.0


def test_misspelled_model_override_is_refused(trained, text_data_bin):
    """A misspelled --model-overrides key (or hub keyword) would be ignored by fairseq, which would run the
    checkpoint as trained; it stops naming the key and the option it is near."""
    from lion_fairseq import LionLanguageModel

    ckpt, _ = trained
    with pytest.raises(ValueError, match=r"'lion_fom' \(did you mean 'lion_form'\)"):
        eval_lm_in_process(text_data_bin, ckpt, "--model-overrides", "{'lion_fom': 'recurrent'}")
    with pytest.raises(ValueError, match=r"'lion_chunk' \(did you mean 'lion_chunk_size'\)"):
        LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin), lion_chunk=8)
    with pytest.raises(ValueError, match=r"'form' \(did you mean 'lion_form'\)"):  # ran the chunk form unsaid
        LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin), form="recurrent")
    # a switched option's bad value is named in the override's spelling (the model names the training flag,
    # which these tools do not take)
    with pytest.raises(ValueError, match=r"--model-overrides .*'lion_form': 'chunky' is none of 'parallel', "
                                         r"'chunk', 'recurrent'; 'lion_chunk_size': '16' is no whole number"):
        eval_lm_in_process(text_data_bin, ckpt, "--model-overrides", "{'lion_form': 'chunky', 'lion_chunk_size': '16'}")
    with pytest.raises(ValueError, match=r"'lion_chunk_size': 0 is no whole number >= 1"):
        LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin), lion_chunk_size=0)
    with pytest.raises(ValueError, match=r"bpe='sentencepeice' is no BPE fairseq knows: did you mean 'sentencepiece'"):
        LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin), bpe="sentencepeice")


def test_lion_override_on_a_softmax_checkpoint_is_ignored_as_fairseq_does(caplog):
    """One --model-overrides string may serve a LION and a transformer_lm checkpoint alike: on the softmax
    one a LION option, or a near miss, is logged and ignored, as fairseq ignores it (the plugin refuses
    nothing on fairseq's own models); on a LION one a misspelling still stops. Neither refuses the keys
    fairseq's hub reads itself, nor the other half's option of an encoder-decoder pair."""
    from omegaconf import OmegaConf

    from lion_fairseq.clear_errors import unknown_override_message

    softmax = OmegaConf.create({"model": {"_name": "transformer_lm", "dropout": 0.1}, "task": {"data": "x"},
                                "generation": {"beam": 5}})
    with caplog.at_level("WARNING"):
        assert unknown_override_message(softmax, {"lion_form": "recurrent", "dropout": 0.0}) is None
        assert unknown_override_message(softmax, {"droput": 0.0}) is None
    assert "'lion_form': a LION option, and this checkpoint is a transformer_lm; ignored" in caplog.text
    assert "'droput': not an option of this transformer_lm checkpoint (did you mean 'dropout'?)" in caplog.text
    lion = OmegaConf.create({"model": {"_name": "lion_roberta", "lion_variant": "s", "lion_form": "chunk",
                                       "encoder_layerdrop": 0.0}, "generation": {"beam": 5}})
    assert "'lion_forms' (did you mean 'lion_form')" in unknown_override_message(lion, {"lion_forms": "recurrent"})
    assert "'lion_temperature' (not an option of this model)" in unknown_override_message(lion, {"lion_temperature": 2})
    for config in (softmax, lion):
        assert unknown_override_message(config, {"generation_args": {"beam": 2}, "load_checkpoint_heads": True,
                                                 "decoder_layerdrop": 0.0, "encoder_layerdrop": 0.0}) is None
    assert "did you mean 'encoder_layerdrop'" in unknown_override_message(lion, {"encoder_layerdrp": 0.0})


def test_generation_keyword_that_is_no_option_is_refused(trained, text_data_bin):
    """fairseq's hub sets any keyword of sample/generate on its generation config, where nothing reads an
    unknown one: a misspelled temperature or a seed ran as if not passed. They stop, naming the option."""
    from lion_fairseq import LionLanguageModel

    ckpt, _ = trained
    hub = LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin))
    with pytest.raises(ValueError, match=r"'temprature' \(did you mean 'temperature'\)"):
        hub.sample("the value", sampling=True, temprature=0.5, max_len_b=4)
    with pytest.raises(ValueError, match=r"'beem' \(did you mean 'beam'\)"):
        hub.sample("the value", beem=2, max_len_b=4)
    with pytest.raises(ValueError, match=r"'seed' \(not a generation option\).*torch\.manual_seed"):
        hub.sample("the value", sampling=True, seed=7, max_len_b=4)
    # the model's options are from_pretrained's
    with pytest.raises(ValueError, match=r"'lion_form' \(a model option: pass it to from_pretrained"):
        hub.sample("the value", lion_form="recurrent", max_len_b=4)
    torch.manual_seed(0)
    assert hub.sample("the value", sampling=True, temperature=0.5, sampling_topk=5, max_len_b=4)
    # fairseq's own hub keyword for the generation config is no misspelling of it
    hub = LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin),
                                            generation_args={"beam": 2})
    assert hub.cfg.generation.beam == 2


def test_hub_takes_texts_longer_than_the_training_max_tokens(trained, text_data_bin):
    """The training run's --max-tokens, kept in the checkpoint, sizes the hub's batches; fairseq stopped on a
    text longer than it (``Sentences lengths should not exceed max_tokens``), though LION-S takes any length.
    The scores are those with room to spare, and the checkpoint's setting is left as it was."""
    from lion_fairseq import LionLanguageModel

    ckpt, _ = trained
    hub = LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin)).eval()
    text = " ".join(Path(text_data_bin).parent.joinpath("train.txt").read_text().split()[:30])
    want = hub.score(text)["positional_scores"]
    hub.cfg.dataset.max_tokens = 8  # as a run trained with --max-tokens 8 keeps it
    assert torch.allclose(hub.score(text)["positional_scores"], want, atol=1e-5)
    assert len(hub.sample(text, beam=1, max_len_b=3).split()) > 30
    assert hub.cfg.dataset.max_tokens == 8


def test_override_of_what_the_weights_were_trained_as_is_refused(trained, text_data_bin):
    """An override of the feature map, the normalisation, the variant, ... loads without a tensor changing
    shape, and fairseq would run another model on the weights: it stops naming what was trained. The form
    switches, and an override equal to what was trained changes nothing and loads, also where the
    checkpoint holds None because the arch decided (the feature map, positions and levers of lion_s_lm)."""
    from lion_fairseq import LionLanguageModel

    ckpt, _ = trained
    with pytest.raises(ValueError, match=r"lion_normalize=False \(trained with (True|the arch's default)\)"):
        eval_lm_in_process(text_data_bin, ckpt, "--model-overrides", "{'lion_normalize': False}")
    with pytest.raises(ValueError, match=r"lion_feature_map='elu' \(trained with 'silu_norm'\).*lion_form and "
                                         r"lion_chunk_size"):
        LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin), lion_feature_map="elu")
    with pytest.raises(ValueError, match=r"lion_positions='learned' \(trained with 'none'\)"):
        LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin), lion_positions="learned")
    model = torch.load(ckpt, weights_only=True)["cfg"]["model"]
    assert model["lion_feature_map"] is None and model["lion_positions"] is None  # the arch decided
    assert LionLanguageModel.from_pretrained(str(ckpt.parent), ckpt.name, str(text_data_bin), lion_form="recurrent",
                                             lion_variant=model["lion_variant"], lion_feature_map="silu_norm",
                                             lion_positions="none", lion_gate_temperature="1.0", lion_short_conv=0)


def test_hub_a_max_len_a_asked_for_says_where_learned_positions_stop_it(text_data_bin, lit_trained):
    """max_len_a alone, in the call or at loading, is a length asked for: running into LION-LIT's 64 learned
    positions is said, as it is for max_len_b (fairseq's default length alone stops there unsaid)."""
    from lion_fairseq import LionLanguageModel

    prompt = " ".join(Path(text_data_bin).parent.joinpath("train.txt").read_text().split()[:40])
    hub = LionLanguageModel.from_pretrained(str(lit_trained.parent), lit_trained.name, str(text_data_bin))
    with pytest.warns(UserWarning, match=r"a prompt of 40 tokens continues by at most 23 tokens"):
        hub.sample(prompt, beam=1, max_len_a=1)
    hub = LionLanguageModel.from_pretrained(str(lit_trained.parent), lit_trained.name, str(text_data_bin), max_len_a=1)
    with pytest.warns(UserWarning, match=r"a prompt of 40 tokens continues by at most 23 tokens"):
        hub.sample(prompt, beam=1)


def test_no_repeat_ngram_bans_what_would_repeat_without_the_cuda_extension():
    """fairseq's blocker read the end of the padded token buffer, so --no-repeat-ngram-size banned nothing on
    CPUs (and GPUs without its CUDA extension): the plugin's demo beam search repeated 'the the the'."""
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    pad = 1
    tokens = torch.tensor([[2, 7, 8, 7, pad, pad], [2, 7, 8, 9, pad, pad]])  # step 3: 4 tokens filled
    for n, banned in ((2, [{8}, set()]), (3, [set(), set()]), (1, [{7, 8}, {7, 8, 9}])):  # never the start's </s>
        lprobs = NGramRepeatBlock(n, use_extension=False)(tokens, torch.zeros(2, 12), 2, 1, 3)
        assert [set(torch.nonzero(row == -math.inf).view(-1).tolist()) for row in lprobs] == banned, n
    tokens[0, 4] = 8  # step 4, '7 8 7 8': the trigram '7 8 7' is banned next
    lprobs = NGramRepeatBlock(3, use_extension=False)(tokens, torch.zeros(2, 12), 2, 1, 4)
    assert torch.nonzero(lprobs[0] == -math.inf).view(-1).tolist() == [7]
