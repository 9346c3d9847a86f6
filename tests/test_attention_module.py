"""``LionAttention`` (and the layers around it) against SPEC section 2 written out in float64: the gates
lambda shifted by hand into the operator's (the paper's mask: key inclusive to query exclusive), the feature
maps, the normaliser, ``--lion-norm-after``, the gate temperature and the output gate; values and the
gradients of the input and of every parameter, in each form, each form seen to run. The operator's own tests compare its forms with a
reference; these catch a layer that feeds it the wrong gates, options or form."""
import pytest
import torch
import torch.nn.functional as F

import lion_fairseq.ops.attention as attention_op
from lion_fairseq.modules.lion_attention import LionAttention
from reference import reference_attention

C, H, T, B = 16, 2, 9, 2
OPTIONS = {
    "paper": {},
    "released MLM ablation": dict(feature_map="identity", normalize=False, norm_after=True),
    "levers": dict(gate_temperature=3.0, output_gate=True),
}
FEATURE_MAPS = {
    "elu": lambda t: F.elu(t) + 1,
    "silu_norm": lambda t: (F.silu(t) + 0.5) / (F.silu(t) + 0.5).norm(dim=-1, keepdim=True),
    "identity": lambda t: t,
}

pytestmark = pytest.mark.usefixtures("one_thread")


def literal(m: LionAttention, x: torch.Tensor, mask: torch.Tensor, feature_map: str) -> torch.Tensor:
    """SPEC section 2 around the float64 reference of section 1 (``tests/reference.py``), its gates lambda
    computed and shifted here, not by the module. x ``(T, B, C)``, mask ``(B, T)`` True at padding."""
    def heads(t):
        return t.reshape(T, B, H, C // H).permute(1, 2, 0, 3)  # (B, H, T, D)

    phi = FEATURE_MAPS[feature_map]
    q, k, v = phi(heads(m.q_proj(x))), phi(heads(m.k_proj(x))), heads(m.v_proj(x))
    tau = m.gate_temperature
    if m.variant == "s":
        lam = torch.sigmoid(m.gate_proj(x)).permute(1, 2, 0) ** (1 / tau)  # (B, H, T)
    elif m.variant == "d":
        lam = (torch.sigmoid(m.gate_logit) ** (1 / tau))[None, :, None].expand(B, H, T)
    else:
        lam = torch.ones(B, H, T, dtype=x.dtype)
    # SPEC section 2 in the operator's terms: f_t = lambda_{t-1}, b_t = lambda_{t+1}, 1 at the ends
    one = torch.ones_like(lam[..., :1])
    f, b = torch.cat([one, lam[..., :-1]], -1), torch.cat([lam[..., 1:], one], -1)
    y = reference_attention(q, k, v, f.log(), b.log(), causal=m.causal, normalize=m.normalize,
                            key_padding_mask=mask, eps=m.eps)
    if m.head_norm is not None:
        y = F.layer_norm(y, (C // H,), m.head_norm.weight, m.head_norm.bias, m.head_norm.eps)
    y = y.permute(2, 0, 1, 3).reshape(T, B, C)
    if m.out_gate is not None:
        y = y * F.silu(m.out_gate(x))
    return m.out_proj(y)


@pytest.fixture
def forms_run(monkeypatch):
    """The forms of the operator that ran, in order: a layer that ignored its form would still agree."""
    ran = []
    for form, name in (("parallel", "parallel_attention"), ("chunk", "chunk_attention"),
                       ("recurrent", "recurrent_attention")):
        def spy(*args, _original=getattr(attention_op, name), _form=form, **kwargs):
            ran.append(_form)
            return _original(*args, **kwargs)
        monkeypatch.setattr(attention_op, name, spy)
    return ran


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_module_equals_the_papers_definition_with_gradients(variant, causal, options, forms_run):
    kwargs = dict(OPTIONS[options])
    if variant == "lit":
        kwargs.pop("gate_temperature", None)  # LIT has no gates to soften
    torch.manual_seed(0)
    m = LionAttention(C, H, variant, chunk_size=4, causal=causal, **kwargs).double()
    with torch.no_grad():  # away from the initial values, which hide mistakes (zero biases, an even gate)
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    feature_map = kwargs.get("feature_map", {"lit": "elu"}.get(variant, "silu_norm"))
    x = torch.randn(T, B, C, dtype=torch.double, requires_grad=True)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 6:] = True  # the second sequence right-padded
    w = torch.randn(T, B, C, dtype=torch.double)
    w[6:, 1] = 0  # what a padded row outputs is not read

    def values_and_grads(run):
        params = [x, *m.parameters()]
        y = run()
        return [y * (w != 0)] + list(torch.autograd.grad((y * w).sum(), params))

    expected = values_and_grads(lambda: literal(m, x, mask, feature_map))
    for form in ("parallel", "chunk", "recurrent"):
        m.form = form
        forms_run.clear()
        got = values_and_grads(lambda: m(x, key_padding_mask=mask))
        assert forms_run == [form]
        for name, a, b in zip(["values", "x", *(n for n, _ in m.named_parameters())], got, expected):
            # the gates are float32 (SPEC section 2): that rounding, no more
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda e: f"{form} form, {name}: {e}")


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("normalize_before", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_layers_put_their_norms_and_activation_where_fairseq_does(kind, normalize_before, activation):
    """Pre-norm ``x + attn(LN(x))`` then ``x + FFN(LN(x))``; post-norm ``LN(x + attn(x))`` then
    ``LN(x + FFN(x))``; written out with the layer's own submodules (the forms' tests compare a layer with
    itself, which a misplaced norm passes)."""
    from lion_fairseq.modules.decoder_layer import LionDecoderLayer
    from lion_fairseq.modules.encoder_layer import LionEncoderLayer

    torch.manual_seed(0)
    attention = dict(variant="s", chunk_size=4)
    if kind == "encoder":
        layer = LionEncoderLayer(C, H, 32, attention, activation_fn=activation, normalize_before=normalize_before)
    else:
        layer = LionDecoderLayer(C, H, 32, attention, activation_fn=activation, normalize_before=normalize_before)
    # both layers take (width, heads, FFN width), LionAttention's order: the decoder's once swapped the last two
    assert (layer.self_attn.num_heads, layer.fc1.out_features) == (H, 32)
    layer = layer.double().eval()
    with torch.no_grad():  # norms that are not the identity, so that a missing one shows
        for norm in (layer.self_attn_layer_norm, layer.final_layer_norm):
            norm.weight.normal_()
            norm.bias.normal_()
    x = torch.randn(T, B, C, dtype=torch.double)
    act = {"relu": F.relu, "gelu": F.gelu}[activation]

    def ffn(h):
        return layer.fc2(act(layer.fc1(h)))

    ln1, ln2, attn = layer.self_attn_layer_norm, layer.final_layer_norm, layer.self_attn
    with torch.enable_grad():  # the whole-sequence path of the encoder layer (without autograd it goes by blocks)
        if normalize_before:
            h = x + attn(ln1(x))
            expected = h + ffn(ln2(h))
        else:
            h = ln1(x + attn(x))
            expected = ln2(h + ffn(h))
        # fairseq's gelu and LION's gates run in float32: that rounding, no more
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalize_before", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_layers_put_their_dropout_where_fairseq_does(kind, normalize_before):
    """In training, ``dropout`` drops the attention's and the FFN's outputs before each residual sum (never
    the residual) and ``activation_dropout`` drops inside the FFN: written out with the layer's own dropout
    modules, drawing the same masks in the same order."""
    from lion_fairseq.modules.decoder_layer import LionDecoderLayer
    from lion_fairseq.modules.encoder_layer import LionEncoderLayer

    torch.manual_seed(0)
    attention, drops = dict(variant="s", chunk_size=4), dict(dropout=0.3, activation_dropout=0.4)
    if kind == "encoder":
        layer = LionEncoderLayer(C, H, 32, attention, normalize_before=normalize_before, **drops)
    else:
        layer = LionDecoderLayer(C, H, 32, attention, normalize_before=normalize_before, **drops)
    layer = layer.double().train()
    x = torch.randn(T, B, C, dtype=torch.double)
    ln1, ln2, attn, drop = layer.self_attn_layer_norm, layer.final_layer_norm, layer.self_attn, layer.dropout_module

    def ffn(h):
        return layer.fc2(layer.activation_dropout_module(layer.activation_fn(layer.fc1(h))))

    torch.manual_seed(1)
    got = layer(x)
    torch.manual_seed(1)
    if normalize_before:
        h = x + drop(attn(ln1(x)))
        expected = h + drop(ffn(ln2(h)))
    else:
        h = ln1(x + drop(attn(x)))
        expected = ln2(h + drop(ffn(h)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, layer.eval()(x))  # the masks dropped something


def test_attention_dropout_drops_in_training_only():
    """``--attention-dropout`` drops the heads' mixed values in training (two passes differ where nothing
    else drops) and nothing in evaluation."""
    from lion_fairseq.modules.encoder_layer import LionEncoderLayer

    x = torch.randn(T, B, C, dtype=torch.double)
    outputs = {}
    for p in (0.0, 0.5):
        torch.manual_seed(0)
        layer = LionEncoderLayer(C, H, 32, dict(variant="s", chunk_size=4), dropout=0.0, attention_dropout=p).double()
        outputs[p] = [layer.train()(x), layer.train()(x), layer.eval()(x), layer.eval()(x)]
    assert torch.equal(outputs[0.0][0], outputs[0.0][1])  # nothing else drops
    assert not torch.equal(outputs[0.5][0], outputs[0.5][1])
    assert torch.equal(outputs[0.5][2], outputs[0.5][3]) and torch.equal(outputs[0.5][2], outputs[0.0][2])


@pytest.mark.parametrize("form", ["parallel", "chunk", "recurrent"])
def test_module_under_torch_compile_equals_eager_with_gradients(form, forms_run):
    """``torch.compile`` of a LionAttention, traced by TorchDynamo (the "eager" backend leaves out the code
    generation, which is inductor's): the chunk form's reused buffers stopped the trace with an
    InternalTorchDynamoError; that form now runs as in eager mode inside the compiled module."""
    torch.manual_seed(0)
    m = LionAttention(C, H, "s", form=form, chunk_size=4)
    x = torch.randn(T, B, C, requires_grad=True)
    grads = []
    for module in (m, torch.compile(m, backend="eager")):
        y = module(x)
        grads.append(torch.autograd.grad((y * y).sum(), [x, *m.parameters()]))
        if module is m:
            eager = y
    assert forms_run == [form, form]
    if form == "parallel":  # the README: compiled in one graph (a log call per operator call had broken it)
        assert torch._dynamo.explain(m)(x).graph_break_count == 0
    torch._dynamo.reset()
    torch.testing.assert_close(y, eager, rtol=1e-6, atol=1e-7)
    for got, expected in zip(*reversed(grads)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_variant_by_its_papers_name_is_refused_with_the_letter_to_use():
    with pytest.raises(ValueError, match=r"variant \(--lion-variant\) must be one of .*LION-RETNET is 'd'"):
        LionAttention(16, 2, "retnet")
