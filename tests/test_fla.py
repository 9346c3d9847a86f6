"""LION on flash-linear-attention (lion_fairseq/ops/fla.py).

Three levels. A naive float64 twin of fla's documented contract (the recurrence of
fla/ops/simple_gla/naive.py, naive_recurrent_simple_gla), which also asserts the input rules the real
kernel has, checks the flips, shifts and gate placement of ``fla_attention`` to float64 round-off. fla's
real Triton kernels then run on CPU under Triton's interpreter (tests/triton_interpreter.py) against the
float64 reference, values and gradients, and at L = 32768 where fp16 would overflow. On CUDA with fla
installed, the compiled kernels are checked against the PyTorch chunk form."""
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import lion_fairseq.ops.attention as attention_mod
import lion_fairseq.ops.fla as fla_mod
from lion_fairseq.ops import lion_attention
from lion_fairseq.ops.fla import fla_attention, fla_available
import triton_interpreter
from reference import fast_reference_attention, reference_attention

B, H, DK, DV = 2, 3, 5, 3  # odd, unequal head dims: fla_attention must pad them for the 16-bit kernels


def naive_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                           output_final_state=False, **kwargs):
    """``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale q_t S_t`` token by token in float64, on fla's
    layout ``(B, T, H, D)``; returns ``(o in q's dtype, None)`` like ``chunk_simple_gla``."""
    Bq, T, Hq, K = q.shape
    V = v.shape[-1]
    assert k.shape == q.shape and v.shape[:3] == (Bq, T, Hq), "fla takes (B, T, H, D)"
    assert q.dtype == k.dtype == v.dtype, "fla's kernels take one dtype for q, k, v"
    assert all(x.is_contiguous() for x in (q, k, v))
    if q.dtype in (torch.float16, torch.bfloat16):  # chunk_bwd_dv's rule (fla/ops/common/chunk_o.py:604-606)
        assert K % 2 == 0 and V % 2 == 0
    assert scale == 1.0, "LION has no 1/sqrt(Dk) scale; fla's default is 1/sqrt(K)"
    assert g_gamma is None and initial_state is None and not output_final_state
    if g is not None:
        assert g.shape == (Bq, T, Hq) and g.is_contiguous()
        assert g.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    naive_chunk_simple_gla.calls.append((q.dtype, K, V, None if g is None else g.dtype))
    qd, kd, vd = q.double(), k.double(), v.double()
    S = qd.new_zeros(Bq, Hq, K, V)
    out = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t].double().exp()[..., None, None]
        S = S + kd[:, t, :, :, None] * vd[:, t, :, None, :]
        out.append(scale * (qd[:, t, :, None, :] @ S).squeeze(-2))
    return torch.stack(out, 1).to(q.dtype), None


naive_chunk_simple_gla.calls = []


@pytest.fixture
def naive_fla(monkeypatch):
    """fla's kernel handle replaced by the naive twin; yields the list of its calls."""
    monkeypatch.setattr(fla_mod, "_load", lambda: naive_chunk_simple_gla)
    naive_chunk_simple_gla.calls = []
    yield naive_chunk_simple_gla.calls


def make_inputs(L, gates, dtype=torch.float64, seed=0, dk=DK, dv=DV):
    """Positive q, k (as LION's feature maps give), signed v, log-gates of the requested kind."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, L, dk, generator=g, dtype=torch.float64) + 0.05
    k = torch.rand(B, H, L, dk, generator=g, dtype=torch.float64) + 0.05
    v = torch.randn(B, H, L, dv, generator=g, dtype=torch.float64)
    if gates == "none":
        f = b = None
    elif gates == "head":
        f = F.logsigmoid(torch.randn(H, 1, generator=g, dtype=torch.float64) + 1)
        b = F.logsigmoid(torch.randn(H, 1, generator=g, dtype=torch.float64) + 1)
    else:
        f = F.logsigmoid(torch.randn(B, H, L, generator=g, dtype=torch.float64) + 1)
        b = F.logsigmoid(torch.randn(B, H, L, generator=g, dtype=torch.float64) + 1)
    return [x.to(dtype) if x is not None else None for x in (q, k, v, f, b)]


def grads(fn, inputs, weight):
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    (fn(*leaves).double() * weight).sum().backward()
    return [x.grad if x is not None else None for x in leaves]


def rel_err(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def rel_rms(x, ref):
    ref = ref.double()
    return ((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


@pytest.fixture(params=["fla", "forward kernels"])
def gated_backward(request, monkeypatch):
    """fla's own backward, or the one made of its forward kernel (where fla refuses its gated backward)."""
    if request.param == "forward kernels":
        monkeypatch.setattr(fla_mod, "fla_backward_refused", lambda x: "refused here")
    return request.param


@pytest.mark.parametrize("L", [1, 7, 33])
@pytest.mark.parametrize("gates", ["none", "head", "token"])
@pytest.mark.parametrize("causal", [False, True])
def test_fla_attention_equals_reference_with_gradients(naive_fla, gated_backward, L, gates, causal):
    """The unnormalised product for M of SPEC section 1, both directions, in float64 through the twin;
    gradients through the twin's own autograd or through ``_GLAFromForwardKernels``'s calls of it."""
    inputs = make_inputs(L, gates, seed=L)

    def fla_fn(q, k, v, f, b):  # fla_attention's contract: gates already (B, H, L)
        ex = lambda x: x.expand(B, H, L) if x is not None else None  # noqa: E731
        return fla_attention(q, k, v, ex(f), ex(b), causal)

    ref_fn = lambda *x: reference_attention(*x, causal=causal, normalize=False)  # noqa: E731
    y = fla_fn(*inputs)
    assert y.shape == (B, H, L, DV) and y.dtype == torch.float64
    assert rel_err(y, ref_fn(*inputs)) < 1e-12
    assert len(naive_fla) == (1 if causal else 2)
    weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gr = grads(fla_fn, inputs, weight)
    by_forward_kernels = gated_backward == "forward kernels" and gates != "none"
    assert len(naive_fla) == (1 if causal else 2) * (2 + 3 * by_forward_kernels)
    for name, g, rg in zip("q k v log_a_fwd log_a_bwd".split(), gr, grads(ref_fn, inputs, weight)):
        if rg is None or (causal and name == "log_a_bwd"):
            continue
        assert g is not None and (g - rg).abs().max() <= 1e-10 * rg.abs().max() + 1e-14, name


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_lion_attention_chunk_goes_through_fla_when_available(naive_fla, monkeypatch, causal, normalize):
    """``lion_attention(form="chunk")`` with fla: the same function as the PyTorch chunk form and the
    reference, with padding on one row; float32 inputs reach the kernel as float32, gates float32."""
    L = 19
    inputs = make_inputs(L, "token", dtype=torch.float32, seed=3)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, -4:] = True
    kw = dict(form="chunk", causal=causal, normalize=normalize, key_padding_mask=mask, chunk_size=8)
    torch_chunk = lion_attention(*inputs, **kw)
    assert not naive_fla  # no CUDA here: fla is not used unless forced
    monkeypatch.setattr(attention_mod, "fla_available", lambda x: True)
    y = lion_attention(*inputs, **kw)
    assert naive_fla and all(c == (torch.float32, 8, 8, torch.float32) for c in naive_fla)
    ref = reference_attention(*[x.double() for x in inputs], causal=causal, normalize=normalize,
                              key_padding_mask=mask)
    assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-5 and rel_err(y, torch_chunk) < 1e-5
    weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fn = lambda *x: lion_attention(*x, **kw)  # noqa: E731
    ref_fn = lambda *x: reference_attention(*x, causal=causal, normalize=normalize, key_padding_mask=mask)  # noqa: E731
    for name, g, rg in zip("q k v log_a_fwd log_a_bwd".split(), grads(fn, inputs, weight),
                           grads(ref_fn, [x.double() for x in inputs], weight)):
        if causal and name == "log_a_bwd":
            continue
        assert (g.double() - rg).abs().max() <= 1e-4 * rg.abs().max() + 1e-6, name


@pytest.mark.parametrize("gated_backward", ["fla", "forward kernels"], indirect=True)
def test_a_second_derivative_through_fla_raises(naive_fla, monkeypatch, gated_backward):
    """fla's backward gives no graph of itself: asked for one (``create_graph=True``, a gradient penalty),
    the chunk form on fla raises, where fla alone would return gradients that miss its terms. (The naive
    twin here is differentiable, so it is the guard that raises.) A first derivative runs."""
    monkeypatch.setattr(attention_mod, "fla_available", lambda x: True)
    q, k, v, f, b = (x.requires_grad_() for x in make_inputs(9, "token", dtype=torch.float32))
    y = lion_attention(q, k, v, f, b, form="chunk")
    assert naive_fla
    with pytest.raises(RuntimeError, match="differentiate twice through flash-linear-attention's kernels"):
        torch.autograd.grad(y.sum(), q, create_graph=True, retain_graph=True)
    (gq,) = torch.autograd.grad(y.sum(), q)
    assert torch.isfinite(gq).all() and gq.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_inputs_reach_fla_in_float32(naive_fla, monkeypatch, dtype):
    """bf16/fp16 inputs reach the kernel in float32 (fla would return, and store its states, in the input
    dtype: fp16 overflows past 65504 and bf16 rounds the row sums); the result is in the input dtype."""
    monkeypatch.setattr(attention_mod, "fla_available", lambda x: True)
    inputs = make_inputs(40, "token", dtype=dtype, dk=6, dv=4)
    q, k, v, f, b = inputs
    y = lion_attention(q, k, v, f.float(), b.float(), form="chunk")
    assert y.dtype == dtype
    assert naive_fla == [(torch.float32, 8, 8, torch.float32)] * 2
    ref = reference_attention(*[x.double() for x in inputs])
    assert rel_rms(y, ref) < 1e-2


def test_long_strong_decay_stays_finite(naive_fla):
    """Gates clamped as lion_attention clamps them (exp -> 0) pass through the shifted keys as zeros."""
    q, k, v, _, _ = make_inputs(9, "none")
    gate = torch.full((B, H, 9), -1e4, dtype=torch.float64)
    y = fla_attention(q, k, v, gate, gate, causal=False)
    # with gates 0 each query sees only its own key
    assert torch.isfinite(y).all()
    assert rel_err(y, (q * k).sum(-1, keepdim=True) * v) < 1e-12


def test_fla_available_rules(monkeypatch):
    monkeypatch.delenv("LION_FLA", raising=False)
    cpu = torch.zeros(1)
    assert not fla_available(cpu)
    cuda_like = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    monkeypatch.setattr(fla_mod, "_load", lambda: None)
    assert not fla_available(cuda_like)  # not installed
    monkeypatch.setattr(fla_mod, "_load", lambda: naive_chunk_simple_gla)
    assert fla_available(cuda_like)
    assert not fla_available(types.SimpleNamespace(is_cuda=True, dtype=torch.float64))
    monkeypatch.setenv("LION_FLA", "0")
    assert not fla_available(cuda_like)
    monkeypatch.setenv("LION_FLA", "off")
    assert not fla_available(cuda_like)
    monkeypatch.setenv("LION_FLA", "nope")  # not left on without a word
    with pytest.raises(ValueError, match="LION_FLA must be 0"):
        fla_available(cuda_like)


def test_missing_fla_says_what_to_install(monkeypatch):
    if fla_mod.importlib.util.find_spec("fla") is None:
        fla_mod._load.cache_clear()
        assert fla_mod._load() is None  # quietly: fla is optional
    monkeypatch.setattr(fla_mod, "_load", lambda: None)
    q, k, v, _, _ = make_inputs(3, "none")
    with pytest.raises(RuntimeError, match="fla-core"):
        fla_attention(q, k, v, None, None, causal=False)


@pytest.mark.skipif(fla_mod.importlib.util.find_spec("fla") is None, reason="needs fla-core installed")
@pytest.mark.parametrize("package, version", [("torch", "2.6.0+cu124"), ("triton", "3.2.0")])
def test_fla_on_older_torch_or_triton_than_it_needs_is_not_used(monkeypatch, package, version):
    """pip installs fla-core on any torch (its torch >= 2.7 and Triton >= 3.3 are its `cuda` extra's): on
    older ones its kernels are not used, with one warning naming the version, and the chunk form runs in
    PyTorch."""
    import triton

    monkeypatch.setattr({"torch": torch, "triton": triton}[package], "__version__", version)
    monkeypatch.delenv("LION_FLA", raising=False)
    fla_mod._load.cache_clear()
    fla_mod._not_loaded_reason.cache_clear()
    try:
        with pytest.warns(UserWarning, match=rf"need {package} >= .* this is {package} {re.escape(version)}"):
            assert fla_mod._load() is None
        cuda_like = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
        assert f"this is {package} {version}" in fla_mod.fla_unavailable(cuda_like)
    finally:
        fla_mod._load.cache_clear()
        fla_mod._not_loaded_reason.cache_clear()


# ---- fla refusing its gated backward: known from the GPU and Triton, gradients from its forward kernel ----

def fake_cuda(monkeypatch, capability, triton_version):
    """A tensor stand-in on a CUDA device of that capability, with that Triton installed."""
    triton = types.ModuleType("triton")
    triton.__version__ = triton_version
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return types.SimpleNamespace(is_cuda=True, device="cuda:0")


@pytest.mark.parametrize("capability, version, refused", [
    ((9, 0), "3.4.0", True), ((9, 0), "3.6.0", True), ((9, 0), "3.7.1", False), ((9, 0), "3.3.1", False),
    ((8, 0), "3.5.0", False), ((10, 0), "3.5.0", False)])
def test_fla_backward_refusal_is_known_from_gpu_and_triton(monkeypatch, capability, version, refused):
    """fla 0.6 raises in the backward of a gated call on Hopper with 3.4 <= Triton < 3.7.1 (fla #640)."""
    x = fake_cuda(monkeypatch, capability, version)
    assert bool(fla_mod.fla_backward_refused(x)) == refused
    assert fla_mod.fla_backward_refused(torch.zeros(1)) is None  # CPU


def test_refused_backward_stays_on_fla_with_the_pytorch_forms_gradients(naive_fla, monkeypatch):
    """Where fla's gated backward is refused, LION-D/S still train on fla: the gradients of
    ``lion_attention`` (normalised, padded) are the PyTorch chunk form's, computed by forward calls of the
    kernel alone; LION-LIT and inference keep fla's own path."""
    L = 21
    inputs = make_inputs(L, "token", dtype=torch.float32, seed=4)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, -5:] = True
    fn = lambda *x: lion_attention(*x, form="chunk", key_padding_mask=mask, chunk_size=8)  # noqa: E731
    weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = grads(fn, inputs, weight)  # the PyTorch chunk form: fla not available yet
    monkeypatch.setattr(attention_mod, "fla_available", lambda x: True)
    monkeypatch.setattr(fla_mod, "fla_backward_refused", lambda x: "refused here")
    for name, g, e in zip("q k v log_a_fwd log_a_bwd".split(), grads(fn, inputs, weight), expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max(), name
    assert len(naive_fla) == 2 + 6  # both directions forward, then three forward calls each for the gradients
    naive_fla.clear()
    with torch.no_grad():
        fn(*inputs)
    grads(fn, inputs[:3] + [None, None], torch.ones(B, H, L, DV, dtype=torch.float64))
    assert len(naive_fla) == 2 + 2  # inference and LION-LIT: fla's own calls (the twin's autograd here)


# ---- fla's real kernels on CPU, under Triton's interpreter ----

needs_interpreter = pytest.mark.skipif(not triton_interpreter.AVAILABLE,
                                       reason="needs triton and fla-core with TRITON_INTERPRET=1 (set without CUDA)")


@pytest.fixture
def real_fla(monkeypatch, one_thread):
    """lion_attention's chunk form on fla's own chunk_simple_gla, interpreted, on one thread; yields the
    dtypes it got."""
    triton_interpreter.install()
    fla_mod._load.cache_clear()
    kernel = fla_mod._load()
    assert kernel is not None, "fla-core does not import"
    calls = []

    def counted(q, *args, **kwargs):
        calls.append(q.dtype)
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(fla_mod, "_load", lambda: counted)
    monkeypatch.setattr(attention_mod, "fla_available", lambda x: True)
    yield calls


@needs_interpreter
@pytest.mark.parametrize("L", [1, 150])
@pytest.mark.parametrize("gates", ["none", "head", "token"])
@pytest.mark.parametrize("causal", [False, True])
def test_real_fla_kernels_equal_the_reference_with_gradients(real_fla, L, gates, causal):
    """fla's kernels in float32 through ``lion_attention``: both directions, each gate kind, one row
    padded on the left and one on the right, values and gradients against the float64 definition."""
    assert_real_kernels_match_reference(real_fla, L, gates, causal)


@needs_interpreter
@pytest.mark.parametrize("gates", ["head", "token"])
@pytest.mark.parametrize("causal", [False, True])
def test_real_fla_forward_kernel_gives_the_gated_gradients(real_fla, monkeypatch, gates, causal):
    """The backward made of fla's forward kernel (``_GLAFromForwardKernels``, what LION-D/S train with where
    fla's own gated backward is refused) against the float64 definition, across several chunks of 64."""
    monkeypatch.setattr(fla_mod, "fla_backward_refused", lambda x: "refused here")
    assert_real_kernels_match_reference(real_fla, 150, gates, causal, calls=1 + 3)


def assert_real_kernels_match_reference(real_fla, L, gates, causal, calls=1):
    inputs = make_inputs(L, gates, dtype=torch.float32, seed=L)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, :L // 4] = True
    mask[1, L - L // 3:] = True
    kw = dict(causal=causal, key_padding_mask=mask)
    fn = lambda *x: lion_attention(*x, form="chunk", **kw)  # noqa: E731
    ref_fn = lambda *x: reference_attention(*x, **kw)  # noqa: E731
    y, ref = fn(*inputs), ref_fn(*[x.double() if x is not None else None for x in inputs])
    assert real_fla == [torch.float32] * (1 if causal else 2)
    assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-5
    weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    real_fla.clear()
    gr = grads(fn, inputs, weight)
    assert len(real_fla) == (1 if causal else 2) * calls
    for name, g, rg in zip("q k v log_a_fwd log_a_bwd".split(), gr,
                           grads(ref_fn, [x.double() if x is not None else None for x in inputs], weight)):
        if rg is None or (causal and name == "log_a_bwd"):
            continue
        assert (g.double() - rg).abs().max() <= 1e-4 * rg.abs().max() + 1e-6, name


def no_decay_reference(q, k, v, causal):
    """LION-LIT's normalised attention in float64 by prefix sums, for L where an L x L matrix won't fit."""
    q, k, v = q.double(), k.double(), v.double()
    if causal:
        S, z = torch.cumsum(k[..., :, None] * v[..., None, :], -3), torch.cumsum(k, -2)
        return (q[..., None, :] @ S).squeeze(-2) / ((q * z).sum(-1, keepdim=True) + 1e-6), (q * z).sum(-1)
    S, den = k.transpose(-1, -2) @ v, q @ k.sum(-2)[..., None]
    return q @ S / (den + 1e-6), den.squeeze(-1)


@needs_interpreter
@pytest.mark.parametrize("dtype, L, causal", [(torch.float16, 16384, False), (torch.bfloat16, 8192, True)])
def test_real_fla_kernels_do_not_overflow_with_16bit_inputs(real_fla, dtype, L, causal):
    """LION-LIT (no decay), row sums growing with L to 8-16 times fp16's 65504. 16-bit inputs reach fla in
    float32, so its states, numerators and row sums are float32 sums; the output is the input dtype."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(1, 1, L, 16, generator=g) * 2 + 1).to(dtype), (torch.rand(1, 1, L, 16, generator=g) * 2 + 1).to(dtype)
    v = torch.randn(1, 1, L, 16, generator=g).to(dtype)
    with torch.no_grad():
        y = lion_attention(q, k, v, form="chunk", causal=causal)
    ref, row_sums = no_decay_reference(q, k, v, causal)
    assert row_sums.max() > 8 * 65504
    assert real_fla == [torch.float32] * (1 if causal else 2)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert rel_rms(y, ref) < (1e-3 if dtype == torch.float16 else 8e-3)  # the output's own rounding


# ---- the real kernels (CUDA with fla installed) ----

HAS_FLA = torch.cuda.is_available() and fla_mod._load() is not None
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="needs CUDA and flash-linear-attention (fla-core)")
# fla's fp32 matmuls run in TF32 (Triton's default), the PyTorch form's in full fp32; bf16 has 8 bits
TOL = {torch.float32: (3e-3, 3e-3), torch.bfloat16: (1e-2, 2e-2)}  # (values, gradients), relative RMS


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L", [1, 63, 64, 65, 1000, 4096])
def test_fla_kernels_match_pytorch_chunk_form(monkeypatch, dtype, causal, L):
    """Values normalised; gradients of the unnormalised product, what fla computes: the row sum's division
    is the same code on both sides, and its q, k gradients at L = 1 are eps-sized differences of terms near
    1, which TF32 rounds 200x larger (measured on an H200, docs/gpu_h200.md)."""
    g = torch.Generator(device="cuda").manual_seed(L)
    D = 64
    q = (torch.rand(2, 4, L, D, device="cuda", generator=g) / D ** 0.5).to(dtype)
    k = (torch.rand(2, 4, L, D, device="cuda", generator=g) / D ** 0.5).to(dtype)
    v = torch.randn(2, 4, L, D, device="cuda", generator=g).to(dtype)
    f = F.logsigmoid(torch.randn(2, 4, L, device="cuda", generator=g) + 2)
    b = F.logsigmoid(torch.randn(2, 4, L, device="cuda", generator=g) + 2)
    weight = torch.randn(2, 4, L, D, device="cuda", generator=g, dtype=torch.float64)
    inputs = [q, k, v, f, b]
    fn = lambda *x: lion_attention(*x, form="chunk", causal=causal)  # noqa: E731
    product = lambda *x: lion_attention(*x, form="chunk", causal=causal, normalize=False)  # noqa: E731
    monkeypatch.setenv("LION_FLA", "1")
    assert fla_available(q)
    y, gr = fn(*inputs), grads(product, inputs, weight)
    monkeypatch.setenv("LION_FLA", "0")
    y_ref, gr_ref = fn(*inputs), grads(product, inputs, weight)
    tol_y, tol_g = TOL[dtype]
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert rel_rms(y, y_ref) < tol_y
    for name, a, r in zip("q k v log_a_fwd log_a_bwd".split(), gr, gr_ref):
        if causal and name == "log_a_bwd":
            continue
        assert torch.isfinite(a).all() and rel_rms(a, r) < tol_g, name


@needs_fla
def test_fla_kernels_match_reference_fp32():
    L = 300
    g = torch.Generator().manual_seed(0)
    inputs = [torch.rand(1, 2, L, 16, generator=g), torch.rand(1, 2, L, 16, generator=g),
              torch.randn(1, 2, L, 8, generator=g), F.logsigmoid(torch.randn(1, 2, L, generator=g) + 2),
              F.logsigmoid(torch.randn(1, 2, L, generator=g) + 2)]
    y = lion_attention(*[x.cuda() for x in inputs], form="chunk")
    assert rel_rms(y.cpu(), fast_reference_attention(*inputs)) < TOL[torch.float32][0]


def test_the_forward_kernels_backward_refuses_a_second_derivative_itself(naive_fla):
    """``_GLAFromForwardKernels``'s own backward raises under ``create_graph=True``, not only the guard that
    ``fla_attention`` puts on its output: without it, its backward would run in grad mode on the naive (here)
    or real forward kernel and return a graph that misses terms to a caller of ``_gla``."""
    g = torch.Generator().manual_seed(0)
    q = (torch.rand(1, 6, 2, 4, generator=g) + 0.05).requires_grad_()
    k = torch.rand(1, 6, 2, 4, generator=g) + 0.05
    v = torch.randn(1, 6, 2, 4, generator=g)
    gate = F.logsigmoid(torch.randn(1, 6, 2, generator=g) + 1)
    y = fla_mod._GLAFromForwardKernels.apply(q, k, v, gate)
    with pytest.raises(RuntimeError, match="differentiate twice through flash-linear-attention's kernels"):
        torch.autograd.grad(y.sum(), q, create_graph=True, retain_graph=True)
    (gq,) = torch.autograd.grad(y.sum(), q)
    assert torch.isfinite(gq).all() and gq.abs().sum() > 0
