"""The operator over a sequence given block by block (``ops.blockwise``) equals it over the whole."""
import pytest
import torch

from lion_fairseq.ops import block_attention, lion_attention, state_after, state_before
from reference import reference_attention, reference_mask
from test_ops import B, DV, H, make_inputs, reference_state, rel_err, zero_gates


def by_blocks(q, k, v, f, b, sizes, form, normalize, mask=None, eps=1e-6):
    """The way a layer streams: right states from right to left, then outputs from left to right."""
    edges = [0]
    for n in sizes:
        edges.append(edges[-1] + n)
    part = lambda x, s, e: x[..., s:e] if x is not None and x.shape[-1] > 1 else x  # noqa: E731
    rows = lambda x, s, e: x[:, :, s:e]  # noqa: E731
    m = lambda s, e: mask[:, s:e] if mask is not None else None  # noqa: E731
    rights, right = [None] * len(sizes), None
    for i in reversed(range(len(sizes))):
        rights[i] = right
        s, e = edges[i], edges[i + 1]
        right = state_before(right, rows(k, s, e), rows(v, s, e), part(b, s, e), m(s, e))
    out, left = [], None
    for i in range(len(sizes)):
        s, e = edges[i], edges[i + 1]
        out.append(block_attention(rows(q, s, e), rows(k, s, e), rows(v, s, e), part(f, s, e), part(b, s, e),
                                   left, rights[i], form=form, normalize=normalize, key_padding_mask=m(s, e),
                                   chunk_size=4, eps=eps))
        left = state_after(left, rows(k, s, e), rows(v, s, e), part(f, s, e), m(s, e))
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("gates", ["none", "head", "token"])
@pytest.mark.parametrize("normalize", [True, False])
def test_blocks_equal_the_whole_sequence(form, gates, normalize):
    L = 16
    inputs = make_inputs(L, gates, seed=5)
    ref = reference_attention(*[x.double() if x is not None else None for x in inputs], normalize=normalize)
    for sizes in ([L], [1, L - 1], [5, 3, 1, 7], [4, 4, 4, 4]):
        y = by_blocks(*inputs, sizes, form, normalize)
        assert y.shape == (B, H, L, DV)
        assert rel_err(y, ref) < 1e-5, sizes


def test_blocks_take_eps_and_return_v_dtype():
    """The eps given (0.5 moves rows by a few percent) and v's dtype, as lion_attention over the whole."""
    L = 16
    inputs = make_inputs(L, "token", seed=5)
    ref = reference_attention(*[x.double() for x in inputs], eps=0.5)
    assert rel_err(by_blocks(*inputs, [5, 11], "chunk", True, eps=0.5), ref) < 1e-5
    low = by_blocks(*[x.bfloat16() for x in inputs], [5, 11], "recurrent", True, eps=0.5)
    assert low.dtype == torch.bfloat16 and rel_err(low, ref) < 3e-2


@pytest.mark.parametrize("side", ["left", "right"])
def test_blocks_with_padding_equal_the_whole_sequence(side):
    L = 14
    q, k, v, f, b = make_inputs(L, "token", seed=6)
    mask = torch.zeros(B, L, dtype=torch.bool)
    if side == "left":
        mask[1, :5] = True
    else:
        mask[1, -5:] = True
    whole = lion_attention(q, k, v, f, b, form="parallel", key_padding_mask=mask)
    y = by_blocks(q, k, v, f, b, [3, 6, 5], "recurrent", True, mask)
    assert rel_err(y, whole) < 1e-5


def test_a_gate_of_zero_is_taken_as_lion_attention_takes_it():
    """Log-gates of -inf (one at a block's first token) give what gates of -1e4 give, and the definition."""
    L, sizes = 16, [5, 3, 1, 7]
    q, k, v, f, b = make_inputs(L, "token", seed=7)
    f, b = zero_gates(f), zero_gates(b)
    ref = reference_attention(q, k, v, f, b)
    for form in ("recurrent", "chunk"):
        y = by_blocks(q, k, v, f, b, sizes, form, True)
        assert torch.isfinite(y).all()
        assert torch.equal(y, by_blocks(q, k, v, f.clamp(min=-1e4), b.clamp(min=-1e4), sizes, form, True))
        assert rel_err(y, ref) < 1e-5
    # the states of the whole sequence: the mask's last row (left state) and first row (right state)
    M = reference_mask(f.double().exp(), b.double().exp(), causal=False)
    for got, w in ((state_after(None, k, v, f), M[..., -1, :]), (state_before(None, k, v, b), M[..., 0, :])):
        for x, x_ref in zip(got, reference_state(k, v, w)):
            assert torch.isfinite(x).all() and rel_err(x, x_ref) < 1e-6


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
@pytest.mark.parametrize("normalize_before,side", [(False, "right"), (True, "right"), (False, "left")])
def test_encoder_layer_recurrent_inference_by_blocks(monkeypatch, variant, normalize_before, side):
    """In eval mode without autograd the recurrent form runs the layer block by block; its output equals
    the whole-sequence layer (autograd on) and the chunk form, padding included (on the left, across a block
    edge: the state carried rightwards must leave the padded keys out)."""
    from lion_fairseq.modules import encoder_layer
    from lion_fairseq.modules.encoder_layer import LionEncoderLayer

    monkeypatch.setattr(encoder_layer, "BLOCK_TOKENS", 8)
    torch.manual_seed(0)
    layer = LionEncoderLayer(32, 4, 64, dict(variant=variant, form="recurrent"),
                             normalize_before=normalize_before).eval()
    if variant == "s":  # gates well away from 1, so that a wrong gate at a block edge shows
        torch.nn.init.normal_(layer.self_attn.gate_proj.weight, std=0.5)
    x = torch.randn(37, 2, 32)
    pad = torch.zeros(2, 37, dtype=torch.bool)
    pad[1, -6:] = side == "right"
    pad[1, :11] = side == "left"
    whole = layer(x, pad)  # autograd on: the whole-sequence path
    with torch.no_grad():
        blocks = layer(x, pad)
        layer.self_attn.form = "chunk"
        chunk = layer(x, pad)
    real = ~pad.t()[..., None].expand_as(x)
    assert rel_err(blocks[real], whole.detach()[real]) < 1e-5
    assert rel_err(blocks[real], chunk[real]) < 1e-5


def test_recurrent_inference_with_autograd_on_warns_once(caplog):
    """RoBERTa's hub runs extract_features with autograd on, where the recurrent form cannot run by blocks:
    a warning says to use torch.no_grad(), once; under no_grad there is nothing to warn of."""
    from lion_fairseq.modules import encoder_layer
    from lion_fairseq.modules.encoder_layer import LionEncoderLayer

    encoder_layer._warn_recurrent_with_autograd.cache_clear()
    layer = LionEncoderLayer(16, 2, 32, dict(variant="s", form="recurrent")).eval()
    x = torch.randn(5, 1, 16)
    with caplog.at_level("WARNING", logger=encoder_layer.__name__):
        with torch.no_grad():
            layer(x)
        assert "torch.no_grad()" not in caplog.text
        layer(x)
        layer(x)
    assert caplog.text.count("run inference under torch.no_grad()") == 1
