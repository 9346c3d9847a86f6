"""The levers of issue 14 (``--lion-gate-temperature``, ``--lion-output-gate``, ``--lion-short-conv``):
every form gives the same outputs, padding changes nothing, recurrent decoding equals the causal forward,
blockwise inference equals the encoder's forward, bad values are refused by name, the options survive a
checkpoint and the archs named after the paper keep the paper's model."""
import argparse

import pytest
import torch

import lion_fairseq  # noqa: F401  (registers the archs)
from lion_fairseq.models.lion_options import lion_attention_kwargs
from lion_fairseq.modules.lion_attention import LionAttention
from lion_fairseq.modules.two_scan_attention import LionTwoScanAttention

C, H = 16, 2
LEVERS = {
    "temperature": dict(gate_temperature=4.0),
    "output_gate": dict(output_gate=True),
    "conv": dict(short_conv=3),
    "all": dict(gate_temperature=4.0, output_gate=True, short_conv=3),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def attention(levers, causal, variant="s", seed=0):
    """A float64 LionAttention with the levers, its convolution taps random (not the identity they start
    as, which would hide a wrong shift), in eval mode."""
    torch.manual_seed(seed)
    kwargs = dict(levers)
    if causal and kwargs.get("short_conv"):
        kwargs["short_conv"] = 4  # an even width: the causal convolution allows it
    m = LionAttention(C, H, variant, form="parallel", chunk_size=4, causal=causal, **kwargs).double().eval()
    if m.conv_weight is not None:
        with torch.no_grad():
            m.conv_weight.normal_()
    return m


def outputs_in_every_form(m, x, mask=None):
    out = {}
    for form in ("parallel", "chunk", "recurrent"):
        m.form = form
        out[form] = m(x, key_padding_mask=mask)
    m.form = "parallel"
    return out


@pytest.mark.parametrize("variant", ["s", "d"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lever", list(LEVERS))
def test_forms_agree(lever, causal, variant):
    m = attention(LEVERS[lever], causal, variant)
    x = torch.randn(13, 2, C, dtype=torch.double)
    out = outputs_in_every_form(m, x)
    for form in ("chunk", "recurrent"):
        torch.testing.assert_close(out[form], out["parallel"], rtol=1e-6, atol=1e-7)


def test_each_lever_changes_the_output():
    """A lever that did nothing would pass every other test here."""
    x = torch.randn(11, 2, C, dtype=torch.double, generator=torch.Generator().manual_seed(0))
    base = attention({}, True)(x)
    for lever, kwargs in LEVERS.items():
        assert not torch.allclose(attention(kwargs, True)(x), base), lever


def test_short_conv_starts_as_the_identity():
    x = torch.randn(9, 2, C)
    torch.manual_seed(1)
    plain = LionAttention(C, H, "s", causal=True)
    torch.manual_seed(1)
    conv = LionAttention(C, H, "s", causal=True, short_conv=4)
    torch.testing.assert_close(conv(x), plain(x))


@pytest.mark.parametrize("causal", [True, False])
def test_padding_changes_nothing(causal):
    """Right padding (and, for the decoder, left padding) leaves the real tokens' outputs as they are
    alone, in every form."""
    m = attention(LEVERS["all"], causal)
    x = torch.randn(12, 2, C, dtype=torch.double)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, 8:] = True
    alone = m(x[:8, 1:2])
    for form, y in outputs_in_every_form(m, x, mask).items():
        torch.testing.assert_close(y[:8, 1:2], alone, rtol=1e-6, atol=1e-7, msg=form)
    if causal:
        left = torch.zeros(2, 12, dtype=torch.bool)
        left[1, :4] = True
        alone = m(x[4:, 1:2])
        for form, y in outputs_in_every_form(m, x, left).items():
            torch.testing.assert_close(y[4:, 1:2], alone, rtol=1e-6, atol=1e-7, msg=form)


@pytest.mark.parametrize("variant", ["s", "d"])
def test_prefill_then_steps_equal_the_causal_forward(variant):
    """Left-padded prompts prefilled in one call, then token by token, with a beam reorder in between:
    the convolution's cache of the last inputs and the state give the full forward's outputs."""
    m = attention(LEVERS["all"], True, variant)
    T, P = 14, 6
    x = torch.randn(T, 3, C, dtype=torch.double)
    order = torch.tensor([2, 0, 1])
    mask = torch.zeros(3, T, dtype=torch.bool)
    mask[1, :2] = True  # the second prompt is 2 tokens shorter, left-padded
    for form in ("parallel", "chunk", "recurrent"):
        m.form = form
        state = {}
        ys = [m(x[:P], key_padding_mask=mask[:, :P], incremental_state=state)]
        m.reorder_incremental_state(state, torch.arange(3))
        for t in range(P, T):
            ys.append(m(x[t:t + 1], incremental_state=state))
        torch.testing.assert_close(torch.cat(ys), m(x, key_padding_mask=mask), rtol=1e-6, atol=1e-7, msg=form)
        # a reorder selects every saved tensor, the convolution's cache included
        state2 = {}
        m(x[:P], incremental_state=state2)
        m.reorder_incremental_state(state2, order)
        step = m(x[P:P + 1, order], incremental_state=state2)
        torch.testing.assert_close(step, m(x[:P + 1, order])[-1:], rtol=1e-6, atol=1e-7)


def test_right_padded_prompt_then_steps():
    """A prompt that ends in padding: the cache holds the last real inputs, not the pads."""
    m = attention(LEVERS["all"], True)
    x = torch.randn(10, 2, C, dtype=torch.double)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 4:] = True  # row 0's prompt has 4 real tokens
    state = {}
    m(x[:6], key_padding_mask=mask, incremental_state=state)
    step = m(x[6:7], incremental_state=state)
    expect = m(torch.cat([x[:4, :1], x[6:7, :1]]))[-1:]
    torch.testing.assert_close(step[:, :1], expect, rtol=1e-6, atol=1e-7)


def test_padded_step_leaves_the_state_as_it_was():
    """A decoding step at a padded position (a row of the batch that waits) changes no state, the
    convolution's cache included: its next real step equals one taken without the padded step."""
    m = attention(LEVERS["all"], True)
    x = torch.randn(7, 2, C, dtype=torch.double)
    waited, direct = {}, {}
    m(x[:5], incremental_state=waited)
    m(x[:5], incremental_state=direct)
    m(x[5:6], key_padding_mask=torch.tensor([[True], [False]]), incremental_state=waited)
    after_pad = m(x[6:7], incremental_state=waited)
    torch.testing.assert_close(after_pad[:, 0], m(x[6:7], incremental_state=direct)[:, 0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(after_pad[:, 1], m(x)[-1, 1:], rtol=1e-6, atol=1e-7)  # the other row stepped


@pytest.mark.parametrize("variant", ["s", "d"])
@pytest.mark.parametrize("block", [1, 3, 5, 16])
def test_blockwise_equals_forward(block, variant):
    """The symmetric convolution reads neighbours across block edges: blocks overlap by its half-width."""
    m = attention(dict(LEVERS["all"], short_conv=5), False, variant)
    T = 13
    x = torch.randn(T, 2, C, dtype=torch.double)
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, 10:] = True
    with torch.no_grad():
        full = m(x, key_padding_mask=mask)
        out = torch.empty_like(full)
        for s, e, y in m.blockwise(lambda s, e: x[s:e], T, mask, block):
            out[s:e] = y
    real = ~mask.t()
    torch.testing.assert_close(out[real], full[real], rtol=1e-6, atol=1e-7)


def test_encoder_layer_streams_blockwise_with_the_levers():
    from lion_fairseq.modules.encoder_layer import LionEncoderLayer

    torch.manual_seed(0)
    layer = LionEncoderLayer(C, H, 32, dict(variant="s", form="chunk", chunk_size=4, short_conv=3,
                                            output_gate=True, gate_temperature=2.0)).double().eval()
    x = torch.randn(20, 2, C, dtype=torch.double)
    with torch.no_grad():
        chunk = layer(x)
        layer.self_attn.form = "recurrent"
        import lion_fairseq.modules.encoder_layer as el
        old, el.BLOCK_TOKENS = el.BLOCK_TOKENS, 6  # several blocks
        try:
            streamed = layer(x)
        finally:
            el.BLOCK_TOKENS = old
    torch.testing.assert_close(streamed, chunk, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs,option", [
    (dict(short_conv=1), "--lion-short-conv"), (dict(short_conv=-2), "--lion-short-conv"),
    (dict(short_conv=4), "--lion-short-conv 4"), (dict(gate_temperature=0.0), "--lion-gate-temperature"),
    # an infinite temperature makes every decay 1: LION-LIT under another name
    (dict(gate_temperature=float("inf")), "--lion-gate-temperature must be a finite number"),
    (dict(gate_temperature=2.0, variant="lit"), "--lion-gate-temperature.*pick a LION-D or LION-S arch"),
    (dict(eps=0.0), r"eps must be > 0 with the row normaliser")])
def test_bad_values_name_the_option(kwargs, option):
    kwargs = dict(kwargs)
    variant = kwargs.pop("variant", "s")
    with pytest.raises(ValueError, match=option):
        LionAttention(C, H, variant, causal=False, **kwargs)


def test_two_scan_refuses_the_convolution():
    with pytest.raises(ValueError, match="--lion-short-conv"):
        LionTwoScanAttention(C, H, "s", height=2, width=2, short_conv=3)


def test_a_config_without_the_levers_is_the_papers_model():
    """Checkpoints saved before the levers existed have none of their fields."""
    old = argparse.Namespace(lion_variant="s", lion_form="chunk", lion_chunk_size=64, lion_feature_map=None,
                             lion_normalize=True, lion_norm_after=False)
    kw = lion_attention_kwargs(old)
    assert (kw["gate_temperature"], kw["output_gate"], kw["short_conv"]) == (1.0, False, 0)


def _lm(tmp_path, *args):
    """(cfg, task, model) of a causal LM as fairseq-train builds them, over a 40-word dictionary."""
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from conftest import training_args

    (tmp_path / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(40)))
    cfg = convert_namespace_to_omegaconf(training_args(tmp_path, "language_modeling", "--tokens-per-sample", "32",
                                                       *args))
    task = tasks.setup_task(cfg.task)
    return cfg, task, task.build_model(cfg.model)


def test_archs_and_checkpoint_round_trip(tmp_path):
    """The paper's arch keeps the paper's model; ``_plus`` adds the levers, each of which a flag turns off;
    a saved checkpoint reloads with the same options and outputs, and its decoding equals its forward."""
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    from lion_fairseq.models.lion_lm import PLUS_LEVERS

    _, _, paper = _lm(tmp_path, "--arch", "lion_s_lm_tiny")
    attn = paper.decoder.layers[0].self_attn
    assert (attn.short_conv, attn.out_gate, attn.gate_temperature) == (0, None, 1.0)
    _, _, off = _lm(tmp_path, "--arch", "lion_s_lm_plus_tiny", "--no-lion-output-gate", "--lion-short-conv", "0",
                    "--lion-gate-temperature", "1")
    attn = off.decoder.layers[0].self_attn
    assert (attn.short_conv, attn.out_gate, attn.gate_temperature) == (0, None, 1.0)

    cfg, _, model = _lm(tmp_path, "--arch", "lion_s_lm_plus_tiny")
    attn = model.decoder.layers[0].self_attn
    assert attn.short_conv == PLUS_LEVERS["lion_short_conv"] and attn.out_gate is not None
    assert attn.gate_temperature == PLUS_LEVERS.get("lion_gate_temperature", 1.0)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attn.conv_weight.normal_()
    model.eval()
    path = tmp_path / "checkpoint.pt"
    # as fairseq's trainer saves it: the config as plain containers
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    checkpoint_utils.torch_persistent_save({"cfg": container, "model": model.state_dict(), "args": None,
                                            "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                                                                   "optimizer_name": "Adam", "num_updates": 0,
                                                                   "lr_scheduler_state": {"best": None}}],
                                            "extra_state": {}}, str(path))
    models, cfg2, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(tmp_path)})
    reloaded = models[0].eval()
    assert (cfg2.model.lion_short_conv, cfg2.model.lion_output_gate) == (cfg.model.lion_short_conv, True)
    tokens = torch.randint(4, 40, (2, 12))
    with torch.no_grad():
        full = model(tokens)[0]
        torch.testing.assert_close(reloaded(tokens)[0], full)
        for form in ("parallel", "recurrent"):
            for layer in reloaded.decoder.layers:
                layer.self_attn.form = form
            state = {}
            steps = [reloaded(tokens[:, :5], incremental_state=state)[0]]
            for t in range(6, 13):
                steps.append(reloaded(tokens[:, :t], incremental_state=state)[0])
            torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_encoder_levers_by_flag(tmp_path):
    """The masked LM takes the levers as flags; an even convolution width is refused by name at build."""
    from conftest import build_model

    (tmp_path / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(40)))
    args = ["--arch", "lion_s_tiny", "--tokens-per-sample", "32", "--lion-output-gate"]
    _, model = build_model(tmp_path, "masked_lm", *args, "--lion-short-conv", "3")
    attn = model.encoder.sentence_encoder.layers[0].self_attn
    assert attn.short_conv == 3 and attn.out_gate is not None and not attn.causal
    with pytest.raises(ValueError, match="--lion-short-conv 4"):
        build_model(tmp_path, "masked_lm", *args, "--lion-short-conv", "4")


def test_recall_data_has_its_known_answer():
    """The quality benchmark's MQAR lines: every query of the second half is a key of the first, followed
    by that key's value."""
    import random

    from lion_fairseq.benchmark.quality import mqar_lines

    for line in mqar_lines(20, 8, random.Random(0)):
        words = line.split()
        assert len(words) == 32
        pairs = dict(zip(words[:16:2], words[1:16:2]))
        assert len(pairs) == 8
        queries = list(zip(words[16::2], words[17::2]))
        assert sorted(k for k, _ in queries) == sorted(pairs) and all(pairs[k] == v for k, v in queries)


@pytest.mark.parametrize("causal", [False, True])
def test_byte_padding_mask_is_the_bool_mask_it_stands_for(causal):
    """An integer key padding mask (older fairseq's byte masks) gives what the bool one gives, through the
    short convolution (which selects with it) and in decoding; a float mask (additive) is refused."""
    torch.manual_seed(0)
    x = torch.randn(6, 2, C)
    mask = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    attn = LionAttention(C, H, "s", causal=causal, short_conv=3, output_gate=True).eval()
    with torch.no_grad():
        assert torch.equal(attn(x, key_padding_mask=mask.to(torch.uint8)), attn(x, key_padding_mask=mask))
        if causal:
            states = [{}, {}]
            steps = [[attn(x[:4], key_padding_mask=m[:, :4], incremental_state=s),
                      attn(x[4:5], key_padding_mask=m[:, 4:5], incremental_state=s)]
                     for m, s in zip((mask.to(torch.uint8), mask), states)]
            assert all(torch.equal(a, b) for a, b in zip(*steps))
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor"):
        attn(x, key_padding_mask=mask.float())
