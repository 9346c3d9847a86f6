"""LION for translation (``lion_transformer``): fairseq's encoder-decoder with LION self-attention, on a
synthetic parallel corpus with a known answer (the target is the source reversed, each word mapped
through a fixed permutation), written by the test.

Decoding through the recurrent state equals the teacher-forced full pass (beam search, its reordering
and its shrinking batch, left-padded sources) for every variant and both kinds of cross-attention; the
decoder's state does not grow with the target; fairseq's own tools train, generate, score and serve it."""
import contextlib
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from conftest import USER_DIR, build_model, fairseq_cli, preprocess, training_args
from lion_fairseq.benchmark.translation import write_reversal_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def mt_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reversal")
    write_reversal_corpus(root)
    out = root / "bin"
    preprocess("--source-lang", "src", "--target-lang", "tgt", "--trainpref", str(root / "train"), "--validpref",
               str(root / "valid"), "--testpref", str(root / "test"), "--destdir", str(out), "--workers", "1")
    return out


def model_args(variant: str, cross: str, *args: str) -> List[str]:
    return ["--arch", f"lion_{variant}_transformer_tiny", "--lion-cross-attention", cross, "--lion-chunk-size", "4",
            *args]


def build(data: Path, variant: str, cross: str, *args: str):
    torch.manual_seed(0)
    task, model = build_model(data, "translation", *model_args(variant, cross, *args))
    task.load_dataset("test")
    return task, model.eval()


def save_checkpoint(path: Path, data: Path, variant: str, cross: str, *args: str):
    """(task, model) as build() gives them, the model saved untrained at ``path`` as fairseq-train saves it."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    ns = training_args(data, "translation", *model_args(variant, cross, *args))
    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(ns), resolve=True, enum_to_str=True)
    task, model = build(data, variant, cross, *args)
    history = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "none", "lr_scheduler_state": {},
                "num_updates": 0}]
    torch.save({"cfg": cfg, "args": None, "model": model.state_dict(), "optimizer_history": history,
                "extra_state": {}}, path)
    return task, model


def batch(task, n: int = 6):
    """The first n test pairs as fairseq batches them: sources left-padded, of different lengths."""
    ds = task.dataset("test")
    return ds.collater([ds[i] for i in range(n)])


def teacher_forced(model, sample, i: int, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[t] | source i, tokens[:t]) by one full forward (no incremental state)."""
    src = sample["net_input"]["src_tokens"][i]
    src = src[src.ne(model.encoder.padding_idx)][None]
    prev = torch.cat([tokens.new_tensor([model.decoder.dictionary.eos()]), tokens[:-1]])[None]
    logits = model(src, torch.tensor([src.shape[1]]), prev)[0]
    return torch.log_softmax(logits.float(), -1)[0].gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("cross", ["softmax", "linear"])
@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_beam_search_scores_equal_the_teacher_forced_pass(mt_data, variant, cross):
    """Beam 4, 2 best: every hypothesis's positional scores, computed step by step through the state
    (reordered after each step, the batch shrinking as sentences finish), equal one full forward."""
    from fairseq.sequence_generator import SequenceGenerator

    task, model = build(mt_data, variant, cross)
    with torch.no_grad():  # an untrained model that ends some sentences early, at different steps
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 6
    sample = batch(task)
    assert sample["net_input"]["src_tokens"][:, 0].eq(task.source_dictionary.pad()).any()  # left-padded
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_a=1, max_len_b=3)
    with torch.no_grad():
        hypos = generator.forward(sample)
        lengths = {len(h[0]["tokens"]) for h in hypos}
        assert len(lengths) > 1  # sentences finish at different steps: the batch shrinks
        for i, beams in enumerate(hypos):
            for h in beams[:2]:
                torch.testing.assert_close(h["positional_scores"], teacher_forced(model, sample, i, h["tokens"]),
                                           atol=1e-4, rtol=1e-4)


def test_decoder_keeps_no_target_by_target_mask(mt_data):
    """fairseq's decoder builds a T x T causal mask for its self-attention and keeps the largest (34 MB at
    3000 target tokens); LION's self-attention is causal by construction, and none is built."""
    task, model = build(mt_data, "s", "softmax")
    sample = batch(task)
    model(**sample["net_input"])[0].sum().backward()
    assert model.decoder._future_mask.numel() == 0


def test_decoder_self_attention_leaves_left_padding_out():
    """fairseq's decoder passes its self-attention the targets' padding mask: with --left-pad-target the pads
    come first, and the real tokens' outputs are those of the sequence without them."""
    from lion_fairseq.modules.seq2seq_attention import LionSelfAttention

    torch.manual_seed(0)
    m = LionSelfAttention(16, 2, variant="s").double()
    x = torch.randn(7, 2, 16, dtype=torch.double)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, :3] = True
    out, _ = m(x, x, x, key_padding_mask=mask)
    torch.testing.assert_close(out[3:, :1], m(x[3:, :1])[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[:, 1:], m(x[:, 1:])[0], rtol=1e-6, atol=1e-7)


def test_alignment_is_refused_where_linear_cross_attention_forms_no_weights(mt_data):
    """--print-alignment reads the decoder's attention over the source: softmax cross-attention aligns;
    linear cross-attention forms no such weights, where fairseq failed transposing an empty tensor
    (IndexError), and is refused naming the option (fairseq-generate, -interactive and the hub all build
    their generator through the task)."""
    from argparse import Namespace

    args = Namespace(print_alignment="hard", beam=2, max_len_a=0, max_len_b=5)
    task, model = build(mt_data, "s", "softmax")
    with torch.no_grad():
        hypos = task.build_generator([model], args).generate([model], batch(task, 2))
    assert hypos[0][0]["alignment"] is not None
    task, model = build(mt_data, "s", "linear")
    with pytest.raises(ValueError, match=r"--print-alignment .*--lion-cross-attention linear.*--lion-cross-attention "
                                         r"softmax"):
        task.build_generator([model], args)
    task.build_generator([model], Namespace(beam=2))  # without alignment it decodes as before


@pytest.mark.parametrize("order", [("softmax", "linear"), ("linear", "softmax")])
def test_score_reference_scores_an_ensemble_of_both_cross_attentions(mt_data, order):
    """fairseq-generate --score-reference --path softmax.pt:linear.pt failed in fairseq's SequenceScorer, which
    averages the models' attention (add_ of linear cross-attention's None); in the other order it averaged the
    softmax one's alone. The attention serves alignment only, which linear cross-attention refuses: the ensemble
    scores with none, each token's probability the average of the models'."""
    from argparse import Namespace

    built = {cross: build(mt_data, "s", cross) for cross in order}
    task = built[order[0]][0]
    models = [built[cross][1] for cross in order]
    sample = batch(task, 3)

    def score(ensemble):
        with torch.no_grad():
            return task.build_generator(ensemble, Namespace(score_reference=True)).generate(ensemble, sample)

    alone = [score([model]) for model in models]
    both = score(models)
    for i, (hypo,) in enumerate(both):
        mean = torch.stack([a[i][0]["positional_scores"].exp() for a in alone]).mean(0).log()
        torch.testing.assert_close(hypo["positional_scores"], mean)
        assert hypo["attention"] is None
    assert alone[order.index("softmax")][0][0]["attention"] is not None  # a softmax model alone keeps it


def test_builds_from_the_parsers_namespace_as_from_its_config(mt_data):
    """fairseq's legacy path builds a model from the parser's Namespace, which lacks every option not
    typed (their defaults are deleted there): the same model as from the config fairseq-train makes."""
    from fairseq import tasks

    ns = training_args(mt_data, "translation", "--arch", "lion_d_transformer_tiny")
    legacy = tasks.setup_task(ns).build_model(ns)
    _, model = build(mt_data, "d", "softmax", "--lion-chunk-size", "64")
    assert {k: v.shape for k, v in legacy.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    attn = legacy.encoder.layers[0].self_attn
    assert (attn.variant, attn.form, attn.chunk_size, attn.normalize) == ("d", "chunk", 64, True)


@pytest.mark.parametrize("cross", ["softmax", "linear"])
def test_decoder_state_is_the_same_after_5_and_500_target_tokens(mt_data, cross):
    task, model = build(mt_data, "s", cross, "--max-target-positions", "1024")
    sample = batch(task, 3)
    reads = []  # linear cross-attention reads the source once per sentence, into its state
    for layer in model.decoder.layers:
        layer.encoder_attn.k_proj.register_forward_hook(lambda *_: reads.append(1))
    with torch.no_grad():
        enc = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
        shapes = []
        for n in (5, 500):
            state: dict = {}
            prev = torch.full((3, 1), task.target_dictionary.eos())
            for _ in range(n):
                logits = model.decoder(prev, encoder_out=enc, incremental_state=state)[0]
                prev = torch.cat([prev, logits[:, -1:].argmax(-1)], 1)
            shapes.append({k: tuple(v.shape) for k, d in state.items() for k2, v in d.items()
                           if torch.is_tensor(v) for k in [f"{k}:{k2}"]})
    assert shapes[0] == shapes[1], shapes  # nothing grows with the target
    if cross == "linear":
        assert len(reads) == 2 * len(model.decoder.layers), len(reads)
    # softmax cross-attention keeps the source's keys and values, linear its (S, z) only
    source = sample["net_input"]["src_tokens"].shape[1]
    assert any(source in s for s in shapes[1].values()) == (cross == "softmax"), (source, shapes[1])


def test_options_reach_the_layers_and_bad_ones_are_refused(mt_data):
    _, model = build(mt_data, "d", "linear", "--lion-form", "recurrent", "--lion-positions", "none")
    enc_attn, dec = model.encoder.layers[0].self_attn, model.decoder.layers[0]
    assert (enc_attn.variant, enc_attn.form, enc_attn.causal) == ("d", "recurrent", False)
    assert (dec.self_attn.variant, dec.self_attn.causal) == ("d", True)
    assert type(dec.encoder_attn).__name__ == "LinearCrossAttention"
    assert model.encoder.embed_positions is None and model.decoder.embed_positions is None
    _, softmax = build(mt_data, "lit", "softmax")
    assert type(softmax.decoder.layers[0].encoder_attn).__name__ == "MultiheadAttention"
    _, learned = build(mt_data, "s", "softmax", "--lion-positions", "learned")  # on both sides
    assert [type(m.embed_positions).__name__ for m in (learned.encoder, learned.decoder)] == \
        ["LearnedPositionalEmbedding"] * 2
    with pytest.raises(ValueError, match="--lion-feature-map identity"):
        build(mt_data, "s", "softmax", "--lion-feature-map", "identity")
    # --lion-positions beside fairseq's own position options trained with no positions at all, saying nothing
    for given in (["--lion-positions", "none", "--encoder-learned-pos"],
                  ["--lion-positions", "learned", "--no-token-positional-embeddings"]):
        with pytest.raises(ValueError, match=f"--lion-positions {given[1]} and {given[2]} both choose the positions"):
            build(mt_data, "s", "softmax", *given)


@pytest.mark.parametrize("attention_dropout", [0.9, 0.0])
def test_attention_dropout_reaches_the_decoders_lion_and_linear_attention(mt_data, attention_dropout):
    """--attention-dropout reached the encoder and softmax cross-attention only, and was silently ignored by
    the decoder's LION self-attention and linear cross-attention: both drop their output (LION forms no
    weights) in train mode, as the encoder's layers do, and not in eval mode."""
    _, model = build(mt_data, "s", "linear", "--attention-dropout", str(attention_dropout), "--dropout", "0")
    src, prev = torch.tensor([[5, 6, 7, 8, 2]]), torch.tensor([[2, 9, 10, 11]])
    with torch.no_grad():
        enc = model.encoder(src, torch.tensor([5]))
    dropped = {}  # the share of zeros in each attention's output, as its output projection reads it
    for name in ("self_attn", "encoder_attn"):
        attention = getattr(model.decoder.layers[0], name)
        attention.out_proj.register_forward_pre_hook(
            lambda _module, args, name=name: dropped.__setitem__(name, args[0].eq(0).float().mean().item()))

    def twice():
        with torch.no_grad():
            return [model.decoder(prev, encoder_out=enc)[0] for _ in range(2)]

    model.decoder.train()
    first, second = twice()
    if attention_dropout:
        assert not torch.allclose(first, second)
        assert min(dropped.values()) > 0.5, dropped
    else:
        torch.testing.assert_close(first, second)
    model.decoder.eval()
    torch.testing.assert_close(*twice())
    assert max(dropped.values()) == 0, dropped
    # softmax cross-attention drops its weights, as fairseq's: not its output a second time
    _, softmax = build(mt_data, "s", "softmax", "--attention-dropout", str(attention_dropout), "--dropout", "0")
    assert not softmax.decoder.layers[0].encoder_attn.out_proj._forward_pre_hooks
    assert bool(softmax.decoder.layers[0].self_attn.out_proj._forward_pre_hooks) == bool(attention_dropout)


def test_norm_after_reaches_the_linear_cross_attention(mt_data):
    """``--lion-norm-after`` normalises the linear cross-attention's heads too: with the released recipe's
    unnormalised sums its output no longer grows with the source (past fp16's range on long ones)."""
    _, model = build(mt_data, "s", "linear", "--lion-feature-map", "identity", "--no-lion-normalize",
                     "--lion-norm-after")
    cross = model.decoder.layers[0].encoder_attn
    query = torch.randn(3, 2, 128)
    memory = torch.randn(1000, 2, 128)

    def growth():  # the output's size over a 1000-token source against a 10-token one
        with torch.no_grad():
            return (cross(query, memory, memory)[0].norm() / cross(query, memory[:10], memory[:10])[0].norm()).item()

    assert growth() < 1.5
    for layer in model.decoder.layers:  # the model as built before the norm reached the cross-attention
        layer.encoder_attn.head_norm = None
    assert growth() > 5  # the check has teeth: without the norm the sum grows with the source

    # a checkpoint of such a model still loads, and runs as it was trained
    task, again = build(mt_data, "s", "linear", "--lion-feature-map", "identity", "--no-lion-normalize",
                        "--lion-norm-after")
    again.load_state_dict(model.state_dict(), strict=True)
    sample = batch(task)["net_input"]
    with torch.no_grad():
        torch.testing.assert_close(again(**sample)[0], model(**sample)[0])


def test_transformers_final_norm_and_embedding_file_options(mt_data, tmp_path):
    """fairseq's transformer options --no-decoder-final-norm and --encoder-embed-path/--decoder-embed-path act
    as there: no LayerNorm after the last pre-norm decoder layer; each side's embeddings start from the file's
    vectors (fairseq's text format: a header line, then a token and its vector per line)."""
    task, model = build(mt_data, "s", "softmax", "--decoder-normalize-before")
    assert model.decoder.layer_norm is not None
    files = {}
    for side, dictionary in (("encoder", task.source_dictionary), ("decoder", task.target_dictionary)):
        vectors = {dictionary[i]: torch.randn(128) for i in range(dictionary.nspecial, dictionary.nspecial + 3)}
        files[side] = (tmp_path / f"{side}.vec", dictionary, vectors)
        files[side][0].write_text("3 128\n" + "".join(
            f"{word} {' '.join(map(str, v.tolist()))}\n" for word, v in vectors.items()))
    _, model = build(mt_data, "s", "softmax", "--decoder-normalize-before", "--no-decoder-final-norm",
                     "--encoder-embed-path", str(files["encoder"][0]), "--decoder-embed-path", str(files["decoder"][0]))
    assert model.decoder.layer_norm is None
    for side, (_, dictionary, vectors) in files.items():
        table = getattr(model, side).embed_tokens.weight
        for word, v in vectors.items():
            torch.testing.assert_close(table[dictionary.index(word)], v)


# ---- fairseq's tools, as a user runs them ---------------------------------------------------------------

TRAIN = ["--task", "translation", "--user-dir", USER_DIR, "--optimizer", "adam", "--lr", "0.003",
         "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20", "--criterion", "label_smoothed_cross_entropy",
         "--label-smoothing", "0.1", "--max-tokens", "1500", "--cpu", "--num-workers", "0", "--no-epoch-checkpoints",
         "--log-format", "json", "--log-interval", "5", "--lion-chunk-size", "4", "--seed", "1"]


@pytest.fixture(scope="module")
def trained(mt_data, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("mt_ckpt")
    fairseq_cli("train", str(mt_data), *TRAIN, "--arch", "lion_s_transformer_tiny", "--max-update", "40",
                "--save-dir", str(save), timeout=900)
    return save / "checkpoint_best.pt"


def test_check_checkpoint_names_both_stacks_and_the_options_to_pass(trained):
    """A translation checkpoint was described as '2 layers' (of 2 + 2), without the options it was trained
    as, the cross-attention among them, which an override may not change."""
    from lion_fairseq.check_checkpoint import explain

    text = explain(str(trained))
    assert "lion_s (a gate per token), 2 encoder and 2 decoder layers, width " in text, text
    assert "It was trained as --arch lion_s_transformer_tiny --encoder-layers 2 " in text, text
    assert re.search(r"--decoder-layers 2 .*--lion-cross-attention softmax", text), text


def generate(data: Path, ckpt: Path, *args: str) -> str:
    return fairseq_cli("generate", str(data), "--user-dir", USER_DIR, "--path", str(ckpt), "--gen-subset", "test",
                       "--batch-size", "16", "--required-batch-size-multiple", "1", "--cpu", *args).stdout


def hypotheses(out: str) -> List[str]:
    return [line for line in out.splitlines() if line.startswith("H-")]


def test_generate_beam_nbest_sampling_prefix_and_bleu(mt_data, trained):
    """fairseq-generate with beam search and --nbest, --max-len-b, sampling and --prefix-size; its BLEU
    line; the same hypotheses and scores in the parallel and the recurrent form (--model-overrides on the
    checkpoint)."""
    beam = {form: generate(mt_data, trained, "--beam", "4", "--nbest", "2", "--max-len-b", "20", "--model-overrides",
                           f"{{'lion_form': '{form}'}}") for form in ("parallel", "recurrent")}
    assert len(hypotheses(beam["parallel"])) == 2 * 40 and "BLEU4 = " in beam["parallel"]
    split = {form: [h.split("\t") for h in hypotheses(out)] for form, out in beam.items()}
    assert len(split["recurrent"]) == 2 * 40
    for (i, score, text), (i2, score2, text2) in zip(split["parallel"], split["recurrent"]):
        assert (i, text) == (i2, text2) and abs(float(score) - float(score2)) < 1e-4
    sampled = generate(mt_data, trained, "--sampling", "--sampling-topk", "5", "--beam", "1", "--seed", "2")
    assert len(hypotheses(sampled)) == 40
    prefixed = generate(mt_data, trained, "--beam", "2", "--prefix-size", "1")
    targets = {line.split("\t")[0][2:]: line.split("\t")[1].split()[0]
               for line in prefixed.splitlines() if line.startswith("T-")}
    for line in hypotheses(prefixed):
        idx, _, text = line.split("\t")
        assert text.split()[0] == targets[idx[2:]]  # the forced first target word


def test_interactive_score_and_hub(mt_data, trained, tmp_path):
    out = fairseq_cli("interactive", str(mt_data), "--user-dir", USER_DIR, "--path", str(trained), "--beam", "2",
                      "--source-lang", "src", "--target-lang", "tgt", "--cpu", stdin="w1 w2 w3\nw4 w5\n").stdout
    assert len([line for line in out.splitlines() if line.startswith("H-")]) == 2
    gen = generate(mt_data, trained, "--beam", "2")
    (tmp_path / "sys.txt").write_text("\n".join(h.split("\t")[2] for h in hypotheses(gen)) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(line.split("\t")[1] for line in gen.splitlines()
                                                 if line.startswith("T-")) + "\n")
    score = subprocess.run([sys.executable, "-m", "fairseq_cli.score", "--sys", str(tmp_path / "sys.txt"),
                            "--ref", str(tmp_path / "ref.txt")], capture_output=True, text=True, check=True)
    assert "BLEU4 = " in score.stdout
    import lion_fairseq  # noqa: F401  (registers the model, as --user-dir does)
    from lion_fairseq.models.lion_transformer import LionTransformerModel

    hub = LionTransformerModel.from_pretrained(str(trained.parent), trained.name, str(mt_data), beam=2)
    assert len(hub.translate("w1 w2 w3").split()) >= 1
    with pytest.raises(ValueError, match="score\\(\\) scores a language model's text; .*--score-reference"):
        hub.score("w1 w2 w3")  # fairseq's failed inside the model (no prev_output_tokens)
    # past the model's max positions: the hub's advice, and its fix for sinusoidal positions, which works
    limit = hub.models[0].max_positions()[0]
    long = " ".join(["w1"] * (limit + 20))
    with pytest.raises(ValueError, match=rf"a text of {limit + 21} tokens is past this model's max_positions.*"
                                         "max_source_positions"):
        hub.translate(long)
    longer = LionTransformerModel.from_pretrained(str(trained.parent), trained.name, str(mt_data), beam=1,
                                                  max_source_positions=limit + 100, max_len_b=5)
    assert len(longer.translate(long).split()) >= 1
    assert torch.load(trained, weights_only=True)["cfg"]["model"]["_name"] == "lion_s_transformer_tiny"


def test_decode_benchmark_state_grows_only_with_softmax_attention(one_thread, monkeypatch):
    """benchmark.translation decode at small size: the decoding state of LION with linear cross-attention
    is the same for any source, softmax cross-attention caches the source, the transformer both sides."""
    from types import SimpleNamespace

    from lion_fairseq.benchmark import translation

    # each model in this process, not in a fresh one (which gives the benchmark a peak RSS of its own, and took
    # 30 s here importing fairseq six times): the state is the model's, wherever it decodes
    pool = SimpleNamespace(apply=lambda f, args: f(*args))
    in_process = SimpleNamespace(Pool=lambda n: contextlib.nullcontext(pool))
    monkeypatch.setattr(translation, "multiprocessing", SimpleNamespace(get_context=lambda method: in_process))
    rows = translation.decode([8, 32], 16, 50)
    mib = {(r["model"], r["S"]): r["state_mib"] for r in rows}
    assert mib["lion_s linear cross-attn", 8] == mib["lion_s linear cross-attn", 32]
    assert mib["lion_s", 8] < mib["lion_s", 32] and mib["transformer", 8] < mib["transformer", 32]
    assert "| 32 | lion_s linear cross-attn |" in translation.decode_table(rows)


def test_override_of_what_the_weights_were_trained_as_is_refused(mt_data, trained):
    """Cross-attention's kind and the positions change no tensor's shape: loaded with another value, the
    weights would run as another model. They are refused, naming what was trained; values equal to what
    the model was built with (the arch's feature map and levers, which the checkpoint holds as None or
    as their values) load."""
    import lion_fairseq  # noqa: F401
    from lion_fairseq.models.lion_transformer import LionTransformerModel

    def hub(**overrides):
        return LionTransformerModel.from_pretrained(str(trained.parent), trained.name, str(mt_data), **overrides)

    with pytest.raises(ValueError, match=r"lion_cross_attention='linear' \(trained with 'softmax'\)"):
        hub(lion_cross_attention="linear")
    with pytest.raises(ValueError, match=r"lion_positions='none' \(trained with the arch's default\)"):
        hub(lion_positions="none")  # fairseq's sinusoidal positions: 'none' would drop them
    with pytest.raises(ValueError, match=r"activation_fn='gelu' \(trained with 'relu'\)"):
        hub(activation_fn="gelu")
    assert hub(lion_form="recurrent", lion_cross_attention="softmax", lion_feature_map="silu_norm",
               lion_gate_temperature=1, lion_output_gate=False, activation_fn="relu")


def test_layerdrop_and_pruning_as_in_transformer(mt_data, trained):
    """fairseq's LayerDrop options (unrecognized before; a layers-to-keep override was dropped on load, every
    layer running): --*-layerdrop builds fairseq's LayerDropModuleList, and a checkpoint loaded with the layers
    to keep is the model of those layers with their trained weights."""
    from fairseq import checkpoint_utils
    from fairseq.modules import LayerDropModuleList

    _, model = build(mt_data, "s", "softmax", "--encoder-layerdrop", "0.5", "--decoder-layerdrop", "0.25")
    assert isinstance(model.encoder.layers, LayerDropModuleList) and model.encoder.layers.p == 0.5
    assert isinstance(model.decoder.layers, LayerDropModuleList) and model.decoder.layers.p == 0.25
    (full,), _ = checkpoint_utils.load_model_ensemble([str(trained)])
    (pruned,), _ = checkpoint_utils.load_model_ensemble(
        [str(trained)], arg_overrides={"encoder_layers_to_keep": "1", "decoder_layers_to_keep": "0"})
    for stack, kept in (("encoder", 1), ("decoder", 0)):
        layers = getattr(pruned, stack).layers
        assert len(layers) == 1, stack
        want = getattr(full, stack).layers[kept].state_dict()
        for name, tensor in layers[0].state_dict().items():
            assert torch.equal(tensor, want[name]), (stack, name)


@pytest.mark.parametrize("side, keep", [("decoder", [0, 2]), ("encoder", [1])])
def test_layers_to_keep_of_one_side_keeps_every_layer_of_the_other(mt_data, tmp_path, side, keep):
    """The README's --model-overrides "{'decoder_layers_to_keep': '0,2'}" alone: fairseq's pruning kept a layer
    only where a side's list named it, so the other side lost every layer and the load failed. The other side
    stays whole, the model is the kept layers' and the config asks no later load to prune again."""
    import copy

    from fairseq import checkpoint_utils

    depth = {"encoder": 3, "decoder": 4}  # unequal: the side kept whole is told apart from the one pruned
    layers = ["--encoder-layers", "3", "--decoder-layers", "4"]
    task, full = save_checkpoint(tmp_path / "layerdrop.pt", mt_data, "s", "softmax", *layers,
                                 "--encoder-layerdrop", "0.5", "--decoder-layerdrop", "0.5")
    (pruned,), cfg = checkpoint_utils.load_model_ensemble(
        [str(tmp_path / "layerdrop.pt")], arg_overrides={f"{side}_layers_to_keep": ",".join(map(str, keep))})
    other = "encoder" if side == "decoder" else "decoder"
    assert (len(getattr(pruned, side).layers), len(getattr(pruned, other).layers)) == (len(keep), depth[other])
    assert cfg.model.encoder_layers_to_keep is None and cfg.model.decoder_layers_to_keep is None
    expected = copy.deepcopy(full)
    stack = getattr(expected, side)
    stack.layers = torch.nn.ModuleList([stack.layers[i] for i in keep])
    stack.num_layers = len(keep)
    sample = batch(task)["net_input"]
    with torch.no_grad():
        torch.testing.assert_close(pruned.eval()(**sample)[0], expected(**sample)[0])


def test_eval_lm_on_a_translation_checkpoint_names_what_scores_it(mt_data, trained, tmp_path):
    """fairseq-eval-lm on a translation checkpoint failed with an AttributeError of fairseq's
    (supported_targets); it names the kind and the tools that score it."""
    import shutil

    shutil.copy(mt_data / "dict.tgt.txt", tmp_path / "dict.txt")
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.eval_lm", str(tmp_path), "--user-dir", USER_DIR,
                           "--path", str(trained), "--cpu"], capture_output=True, text=True, timeout=600)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "holds a lion_transformer model (--arch lion_s_transformer_tiny)" in last, last
    assert "fairseq-generate" in last


def test_learned_positions_a_model_lacks_are_named_with_the_options_that_give_them(mt_data):
    """A LION-LIT translation checkpoint with learned positions (or a softmax teacher's: LION-LIT's tensors
    are the same) loaded into a model with fairseq's sinusoidal ones: refused naming them as not learned,
    with the options that build them."""
    learned = build(mt_data, "lit", "softmax", "--encoder-learned-pos", "--decoder-learned-pos")[1].state_dict()
    model = build(mt_data, "lit", "softmax")[1]
    with pytest.raises(RuntimeError, match=r"the checkpoint has \d+ learned positions and the model no learned "
                                           r"positions; pass --lion-positions learned \(fairseq's "
                                           r"--encoder-learned-pos --decoder-learned-pos\)"):
        model.load_state_dict(learned)
    for fix in (["--lion-positions", "learned"], ["--encoder-learned-pos", "--decoder-learned-pos"]):
        build(mt_data, "lit", "softmax", *fix)[1].load_state_dict(learned)


def test_no_learned_positions_a_model_has_too_many_of_are_named_without_fairseqs_options(mt_data):
    """The other way round: a checkpoint without learned positions into a model with them is told
    --lion-positions none, without fairseq's --encoder-learned-pos --decoder-learned-pos (which would add them)."""
    plain = build(mt_data, "lit", "softmax")[1].state_dict()
    model = build(mt_data, "lit", "softmax", "--lion-positions", "learned")[1]
    with pytest.raises(RuntimeError, match=r"the checkpoint has no learned positions and the model \d+ learned "
                                           r"positions; pass --lion-positions none\.$") as refused:
        model.load_state_dict(plain)
    assert "--encoder-learned-pos" not in str(refused.value)
