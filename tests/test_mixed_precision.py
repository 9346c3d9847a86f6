"""Mixed precision as fairseq runs it on a GPU cluster, with CPU autocast standing in for CUDA's (both
cast the inputs of every matmul to the low precision): ``--amp`` runs the forward under autocast (fp16),
bf16 alike. The operator keeps its sums in float32 whatever autocast does; a training step makes no host
sync; a non-finite value in training reaches fairseq's loss scaler instead of stopping one rank."""
import warnings

import pytest
import torch

from conftest import build_model
from lion_fairseq.benchmark.precision import relative_error

# in-process torch work on one thread: the suite runs two files side by side on two cores
pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = {"fp16": 1e-2, "bf16": 2e-2}
SOFTMAX_FACTOR = 20  # at most this many times the error of fairseq's softmax attention under the same autocast
LONG = 4096


@pytest.fixture(scope="module")
def softmax_error():
    """fairseq's MultiheadAttention at the same width and L = LONG, per dtype."""
    return {dtype: relative_error("softmax", "-", LONG, dtype) for dtype in TOLERANCE}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("form, L", [("parallel", LONG), ("chunk", LONG), ("recurrent", LONG), ("chunk", 16384),
                                     ("recurrent", 16384)])
@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_attention_under_autocast_is_as_accurate_as_softmax(softmax_error, variant, form, L, dtype):
    """LionAttention (width 256, 4 heads) under CPU autocast against itself in float64. LION-LIT's row
    sums pass fp16's 65504 from L ~ 1000: autocast must not reach the operator's matmuls."""
    err = relative_error(variant, form, L, dtype)
    assert err <= TOLERANCE[dtype] and err <= SOFTMAX_FACTOR * softmax_error[dtype], (err, softmax_error[dtype])


def test_unnormalised_fp16_module_keeps_its_sums_in_float32():
    """``--fp16`` with ``--no-lion-normalize --lion-norm-after``: a half-precision module's unnormalised sums
    over L keys pass fp16's 65504 at L = 2048, and stay finite only because its values are taken in float32."""
    from lion_fairseq.modules import LionAttention

    torch.manual_seed(0)
    m = LionAttention(32, 2, "lit", normalize=False, norm_after=True, feature_map="elu").half().eval()
    with torch.no_grad():
        y = m((torch.randn(2048, 1, 32) * 4).half())
    assert y.dtype == torch.float16 and torch.isfinite(y).all()


def test_a_dtype_autocast_does_not_take_is_refused_not_measured_in_float32(monkeypatch):
    """torch 2.1's CPU autocast took no float16: it warned and ran float32, whose error would have filled
    the table's fp16 column. Autocast that stays off stands in for it."""
    import lion_fairseq.benchmark.precision as precision

    real = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda device, dtype: real(device, dtype=dtype, enabled=False))
    with pytest.raises(RuntimeError, match="cannot autocast to fp16 on cpu"):
        precision.relative_error("lit", "chunk", 16, "fp16")


def test_autocast_is_read_on_torch_before_2_4(monkeypatch):
    """torch before 2.4 took no device in ``torch.is_autocast_enabled`` (CUDA's) and asked for the CPU's
    with ``is_autocast_cpu_enabled``: ``autocast_enabled``, which decides whether the attention's inputs
    are cast to the projections' dtype, reads both there."""
    from lion_fairseq.ops import float32

    class TorchBefore24:
        """torch as ``float32`` sees it, with the autocast queries of torch 2.3."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def is_autocast_enabled(*device):
            if device:
                raise TypeError("is_autocast_enabled() takes 0 positional arguments but 1 was given")
            return torch.is_autocast_enabled("cuda")

        @staticmethod
        def is_autocast_cpu_enabled():
            return torch.is_autocast_enabled("cpu")

    monkeypatch.setattr(float32, "torch", TorchBefore24())
    assert not float32.autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float32.autocast_enabled("cpu") and not float32.autocast_enabled("cuda")
        assert not float32.autocast_enabled("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA autocast is turned off where CUDA is")
def test_operator_turns_off_no_cuda_autocast_without_cuda(monkeypatch):
    """Older torch warned at each ``torch.autocast("cuda")`` on a machine without CUDA, even a disabled one
    (pytorch issue 83733): the ops, which turn autocast off around every call, enter none there."""
    from lion_fairseq.modules import LionAttention

    real = torch.autocast

    def old_torch_autocast(device_type, *args, **kwargs):
        if device_type == "cuda":
            warnings.warn("User provided device_type of 'cuda', but CUDA is not available. Disabling")
        return real(device_type, *args, **kwargs)

    monkeypatch.setattr(torch, "autocast", old_torch_autocast)
    x = torch.randn(8, 2, 32, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for variant in ("lit", "s"):
            for form in ("parallel", "chunk", "recurrent"):
                LionAttention(32, 2, variant, form=form)(x).sum().backward()
            state = {}
            decoder = LionAttention(32, 2, variant, causal=True)
            decoder(x[:4], incremental_state=state)
            decoder(x[4:5], incremental_state=state)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_blockwise_inference_and_decoding_under_autocast(dtype):
    """The recurrent form's other paths: an encoder layer's block-by-block inference (states carried
    between blocks) and token-by-token decoding (lion_step) of LION-LIT, whose states grow with L."""
    from lion_fairseq.modules import LionAttention, LionEncoderLayer

    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    layer = LionEncoderLayer(256, 4, 512, dict(variant="lit", form="recurrent")).eval()
    x = torch.randn(2048, 1, 256)
    decoder = LionAttention(256, 4, "lit", causal=True).eval()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=low):
            y = layer(x)
            state = {}
            decoder(x[:1500], incremental_state=state)
            steps = torch.cat([decoder(x[t:t + 1], incremental_state=state) for t in range(1500, 1510)])
        y64 = layer.double()(x.double())
        full = decoder.double()(x[:1510].double())[1500:]
    for name, a, ref in (("blockwise", y, y64), ("decoding", steps, full)):
        assert float((a.double() - ref).norm() / ref.norm()) <= TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_decoding_step_keeps_its_sums_in_float32_under_autocast(dtype):
    """lion_step's ``q_t S``, whose state S sums the whole context: under autocast it ran in 16 bits, so a
    LION-LIT state past fp16's 65504 (70,000 tokens) gave inf, and bf16 rounded every step. It now gives
    what it gives without autocast, with and without gates."""
    from lion_fairseq.ops import lion_step

    torch.manual_seed(0)
    q, k = torch.rand(2, 2, 2, 16).unbind(0)  # positive, as LION's feature maps give
    v = torch.randn(2, 2, 16)
    state = (torch.rand(2, 2, 16, 16) * 7e4, torch.rand(2, 2, 16) * 7e4)
    for log_a in (None, torch.full((2, 2), -1e-4)):
        expected, expected_state = lion_step(q, k, v, log_a, state)
        with torch.autocast("cpu", dtype={"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]):
            y, new_state = lion_step(q, k, v, log_a, state)
        assert torch.equal(y, expected) and all(map(torch.equal, new_state, expected_state))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("task, arch", [("masked_lm", "lion_lit_tiny"), ("masked_lm", "lion_d_tiny"),
                                        ("masked_lm", "lion_s_tiny"), ("language_modeling", "lion_s_lm_tiny")])
def test_model_forward_and_backward_under_autocast(text_data_bin, task, arch, dtype):
    """A whole model's features at L = 2048 and the gradients of its attention weights under autocast,
    against the same model in float32: what fairseq's ``--amp`` step computes (loss scaling aside)."""
    L = 2048
    torch.manual_seed(0)
    _, model = build_model(text_data_bin, task, "--arch", arch, "--tokens-per-sample", str(L), "--dropout", "0",
                           "--lion-chunk-size", "64")
    tokens = torch.randint(4, 100, (1, L), generator=torch.Generator().manual_seed(1))
    attention = [p for name, p in model.named_parameters() if ".self_attn." in name]
    results = {}
    for autocast in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            features = model(tokens, features_only=True)[0].float()
        weight = torch.randn(features.shape, generator=torch.Generator().manual_seed(2))
        (features * weight).sum().backward()
        results[autocast] = features.detach(), torch.cat([p.grad.flatten() for p in attention])
    tol = TOLERANCE["fp16" if dtype == torch.float16 else "bf16"]
    for name, (x16, x32) in zip(("features", "attention gradients"), zip(results[True], results[False])):
        assert torch.isfinite(x16).all(), name
        assert float((x16 - x32).norm() / x32.norm()) <= tol, name


@pytest.mark.parametrize("how", ["cast", "autocast"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_bfloat16_inference_of_a_padded_batch_stays_near_float32(text_data_bin, how, form):
    """An encoder in eval mode cast to bfloat16 (what fairseq's bf16 does to a model) or under autocast,
    as the long-document benchmark runs it: the real tokens' features of a right-padded batch stay near
    the float32 model's (the recurrent form runs block by block)."""
    L = 1024
    torch.manual_seed(0)
    _, model = build_model(text_data_bin, "masked_lm", "--arch", "lion_s_tiny", "--tokens-per-sample", str(L),
                           "--lion-chunk-size", "64", "--lion-form", form)
    model.eval()
    pad = model.encoder.sentence_encoder.padding_idx
    tokens = torch.randint(4, 100, (2, L), generator=torch.Generator().manual_seed(1))
    tokens[1, -100:] = pad
    with torch.no_grad():
        full = model(tokens, features_only=True)[0]
        if how == "cast":
            low = model.to(torch.bfloat16)(tokens, features_only=True)[0]
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = model(tokens, features_only=True)[0]
    real = tokens.ne(pad)
    assert torch.isfinite(low).all()
    assert float((low.float() - full)[real].norm() / full[real].norm()) <= TOLERANCE["bf16"]


# ---- training makes no host sync, and lets fairseq handle what is not finite -----------------------------

SYNCS = ("item", "__bool__", "__float__", "__int__", "tolist")


@pytest.fixture
def host_syncs(monkeypatch):
    """Every call of a Tensor method that copies a value to the host (a device sync on a GPU)."""
    calls = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


def layers():
    from lion_fairseq.modules import LionDecoderLayer, LionEncoderLayer
    from lion_fairseq.modules.two_scan_attention import LionTwoScanAttention

    for variant in ("lit", "d", "s"):
        for form in ("parallel", "chunk", "recurrent"):
            attention = dict(variant=variant, form=form, chunk_size=8)
            yield f"encoder-{variant}-{form}", LionEncoderLayer(32, 2, 64, attention, attention_dropout=0.1)
            yield f"decoder-{variant}-{form}", LionDecoderLayer(32, 2, 64, attention)
            yield f"two-scan-{variant}-{form}", LionTwoScanAttention(32, 2, variant, form=form, chunk_size=8,
                                                                   height=4, width=5)


def test_training_step_of_every_layer_makes_no_host_sync(host_syncs):
    """Forward and backward in train mode, with padding, in every variant and form: no ``.item()``,
    ``bool()``, ``float()``, ``int()`` or ``.tolist()`` on a tensor (each one a device->host sync per layer
    and step on a GPU)."""
    pad = torch.zeros(3, 20, dtype=torch.bool)
    pad[0, -5:] = True
    for name, layer in layers():
        x = torch.randn(20, 3, 32, requires_grad=True)
        host_syncs.clear()
        layer.train()(x, pad).sum().backward()
        assert not host_syncs, f"{name}: {host_syncs}"
        assert torch.isfinite(x.grad).all(), name


def test_nan_in_training_reaches_the_loss_and_gradients(text_data_bin):
    """fairseq's trainer takes a FloatingPointError from the forward as fatal (crash.pt, and only the rank
    that raised stops); a non-finite loss or gradient it handles: the fp16/amp loss scaler skips the step,
    otherwise its NaN detector reports it on every rank alike. So training lets a NaN through."""
    _, model = build_model(text_data_bin, "masked_lm", "--arch", "lion_s_tiny", "--tokens-per-sample", "32")
    with torch.no_grad():
        model.encoder.sentence_encoder.embed_tokens.weight[7] = float("nan")
    tokens = torch.full((1, 12), 9)
    tokens[0, 5] = 7
    loss = model.train()(tokens)[0].float().logsumexp(-1).sum()
    loss.backward()
    assert torch.isnan(loss)
    assert not torch.isfinite(model.encoder.sentence_encoder.embed_tokens.weight.grad).all()


def test_output_projection_takes_the_16_bit_output_as_it_is_under_autocast():
    """Under autocast the attention's 16-bit output goes into ``out_proj`` as it is: cast to the float32
    weights' dtype first, it would make a full-size round trip (to float32, and back by autocast) each
    forward and backward (``--amp``)."""
    seen = []
    for name, layer in layers():
        if name.startswith("two-scan"):  # its output is float32 by design: the two scans' sum
            continue
        attention = getattr(layer, "self_attn", layer)
        handle = attention.out_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        x = torch.randn(20, 3, 32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x, None)
        handle.remove()
        assert seen.pop() == torch.bfloat16, name
        out.float().sum().backward()
