"""LION's own Triton kernel (lion_fairseq/ops/kernel.py) against the float64 reference, values and the
gradients of q, k, v and both gates, run on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py; tests/triton_interpreter.py), and against the PyTorch chunk form on CUDA where there is one.

The interpreter multiplies float16 correctly and bfloat16 on its raw bits: float16 runs the kernel's own
16-bit products, bfloat16 runs with its loads converted to float32 inside the kernel (what the kernel does
there; its stores round to nearest as a GPU's do, tests/triton_interpreter.py), and the rest runs in
float32. Chunks of 16 tokens and segments of two chunks make short sequences
cross chunk and segment borders."""
import itertools
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import lion_fairseq.ops.backend as backend_mod
from lion_fairseq.modules import LionAttention
from lion_fairseq.ops import lion_attention
from reference import fast_reference_attention, reference_attention

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (INTERPRETED or torch.cuda.is_available()) or backend_mod._triton_missing(),
                                reason="needs Triton: on CUDA, or on CPU under TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H = 2, 2


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    if INTERPRETED:
        import triton_interpreter

        triton_interpreter.install()


def kernel(*args, segment_chunks=None, **kw):
    from lion_fairseq.ops.kernel import kernel_attention

    q, k, v, f, b = args
    kw = dict(dict(causal=False, normalize=True, key_padding_mask=None, eps=1e-6, chunk_size=16), **kw)
    return kernel_attention(q, k, v, f, b, kw["causal"], kw["normalize"], kw["key_padding_mask"], kw["eps"],
                            kw["chunk_size"], segment_chunks)


def make_inputs(L, gates, D=32, seed=0, dtype=torch.float64):
    """Positive q, k (as LION's feature maps give), signed v; log-gates per head ``(1, H, 1)`` or per token."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, L, D, generator=g, dtype=torch.float64) + 0.05
    k = torch.rand(B, H, L, D, generator=g, dtype=torch.float64) + 0.05
    v = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    shape = {"none": None, "head": (1, H, 1), "token": (B, H, L)}[gates]
    f = b = None
    if shape:
        f = F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64) + 1)
        b = F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64) + 1)
    return [x.to(dtype).to(DEVICE) if x is not None else None for x in (q, k, v, f, b)]


def padding(L):
    """Row 0 padded on the right, row 1 on the left: both sides in one call."""
    mask = torch.zeros(B, L, dtype=torch.bool)
    n = max(1, L // 4)
    mask[0, L - n:] = True
    mask[1, :n] = True
    return mask.to(DEVICE) if L > 1 else None


def value_and_grads(fn, inputs, weight):
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    y = fn(*leaves)
    (y.double() * weight).sum().backward()
    return y, [x.grad if x is not None else None for x in leaves]


def max_err(x, ref, scale):
    return ((x.double() - ref.double()).abs().max() / scale).item()


def check_against_reference(fn, inputs, ref_kw, tol_y, tol_g, rms=False, tol_gate=None):
    """Values and the gradients of every tensor input of ``fn`` against ``reference_attention``.
    A gradient's error is relative to its own largest entry, or to a hundredth of the largest
    gradient of any input where that is larger: at L = 1 the normalised output does not depend on q and
    k at all, its true gradients there are eps-sized, and float32 gets them as differences of terms near
    1 (the PyTorch forms too). ``tol_gate``: the gates' tolerance (default ``tol_g``)."""
    L, Dv = inputs[2].shape[2], inputs[2].shape[3]
    # representable in the inputs' dtype, so that the output's gradient reaches both sides unrounded
    weight = torch.randn(B, H, L, Dv, generator=torch.Generator().manual_seed(1)).to(inputs[2].dtype).double()
    weight = weight.to(DEVICE)
    ref = reference_attention if L <= 64 else fast_reference_attention
    ref_fn = lambda *x: ref(*x, **ref_kw)  # noqa: E731
    y_ref, g_ref = value_and_grads(ref_fn, [x.double() if x is not None else None for x in inputs], weight)
    y, g = value_and_grads(fn, inputs, weight)
    assert y.dtype == inputs[2].dtype and y.shape == y_ref.shape
    err = (lambda a, r, s: ((a.double() - r).pow(2).mean().sqrt() / s).item()) if rms else max_err
    size = (lambda r: r.pow(2).mean().sqrt()) if rms else (lambda r: r.abs().max())
    assert err(y, y_ref, size(y_ref)) < tol_y
    floor = 1e-2 * max(size(r) for r in g_ref if r is not None)
    for name, a, r in zip("q k v log_a_fwd log_a_bwd".split(), g, g_ref):
        if r is None or (ref_kw.get("causal") and name == "log_a_bwd"):
            continue
        assert a is not None and a.shape == inputs["q k v log_a_fwd log_a_bwd".split().index(name)].shape
        assert torch.isfinite(a).all(), name
        if name.startswith("log") and a.shape[-1] == L > 1:  # f_0 and b_{L-1} lie on no path: exactly 0
            assert not a[..., 0 if name == "log_a_fwd" else -1].any(), name
        tol = tol_gate if tol_gate is not None and name.startswith("log") else tol_g
        assert err(a, r, max(size(r), floor)) < tol, name


# every gate kind, causal and bidirectional, normalised and not at L = 1 and 53; at L = 64 each gate kind
# and each of causal, bidirectional, normalised and not once (the interpreter is slow: no full product)
CASES = [(L, gates, causal, normalize) for L in (1, 53) for gates in ("none", "head", "token")
         for causal, normalize in itertools.product([False, True], [True, False])]
CASES += [(64, "none", False, True), (64, "head", False, False), (64, "token", True, True), (64, "token", True, False)]


@pytest.mark.parametrize("L,gates,causal,normalize", CASES)
def test_kernel_equals_reference(L, gates, causal, normalize):
    """Every gate kind, causal and bidirectional, normalised and not; L = 1, L not a multiple of the
    chunk (53: four chunks in two segments, with padding on both sides), and L a multiple of it (64, no
    padding)."""
    inputs = make_inputs(L, gates, seed=L, dtype=torch.float32)
    pad = padding(L) if L != 64 else None
    kw = dict(causal=causal, normalize=normalize, key_padding_mask=pad)
    check_against_reference(lambda *x: kernel(*x, segment_chunks=2, **kw), inputs, kw, 1e-5, 1e-5)


@pytest.mark.parametrize("D", [32, 64, 128, 40])
def test_kernel_head_sizes(D):
    """The archs' head sizes, and one that is not a power of two, in chunks of 64 (the default). The
    loss reads every row, padded queries too: a left-padded query whose keys all lie 25 strong decays away
    has a row sum below eps, and the per-head gate's gradient gathers a part from those rows that cancels
    most of the rest: measured here in float32, 2.7e-5 (the recurrent form 2.0e-5, the PyTorch chunk form
    1.7e-5, the parallel form 3.1e-6); 1e-7 with the padded rows' outputs out of the loss, as fairseq's
    losses leave them."""
    inputs = make_inputs(100, "token" if D != 64 else "head", D=D, seed=D, dtype=torch.float32)
    kw = dict(key_padding_mask=padding(100))
    check_against_reference(lambda *x: kernel(*x, chunk_size=64, **kw), inputs, kw, 1e-5, 1e-5, tol_gate=5e-5)


# relative RMS errors allowed with 16-bit inputs: values, gradients of q, k, v, of the gates. Measured at
# L = 100, the worse of per-head and per-token gates: float16 2.7e-4, 6.6e-4, 5.1e-4 (its products run in
# float16); bfloat16 1.7e-3, 1.7e-3, 2.3e-5 (its products in float32 here, its stores rounded to nearest as
# a GPU's are: tests/triton_interpreter.py). The PyTorch chunk form, which rounds once to 16 bits, gets
# 2.1e-4 (float16) and 1.7e-3 (bfloat16), and 6e-6 for the gates, which it returns in float32.
SIXTEEN_BIT_TOLERANCE = {torch.float16: (5e-4, 1e-3, 1e-3), torch.bfloat16: (5e-3, 5e-3, 5e-4)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gates", ["head", "token"])
def test_kernel_16bit_inputs(dtype, gates):
    """16-bit q, k, v are read as they are (no float32 copies) and the result comes back in their dtype,
    with float32 gates, within a few roundings of the 16-bit inputs' own float64 reference (relative RMS).
    What one launch leaves for the next to add to is kept to float32's precision (before: the gradients
    of q, k, v 6x, the per-head gate's 1e4x, further off than the PyTorch form's), and float16 stays finite
    where a padded row's sum is below eps (do = dy / eps overflowed float16: NaN gradients)."""
    L = 100
    q, k, v, f, b = make_inputs(L, gates, D=64, seed=5, dtype=torch.float64)
    inputs = [x.to(dtype) for x in (q, k, v)] + [f.float(), b.float()]
    kw = dict(key_padding_mask=padding(L))
    tol_y, tol_g, tol_gate = SIXTEEN_BIT_TOLERANCE[dtype]
    check_against_reference(lambda *x: kernel(*x, segment_chunks=2, **kw), inputs, kw, tol_y, tol_g, rms=True,
                            tol_gate=tol_gate)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,normalize", [(True, True), (False, False)])
def test_kernel_16bit_causal_and_unnormalised(dtype, causal, normalize):
    """The other ways a 16-bit sum passes between launches: a causal call (one walk, each gradient
    written once, y kept as a pair for the backward) and an unnormalised one (y's pair only between the
    walks, none kept)."""
    q, k, v, f, b = make_inputs(50, "token", D=32, seed=7, dtype=torch.float64)
    inputs = [x.to(dtype) for x in (q, k, v)] + [f.float(), b.float()]
    kw = dict(key_padding_mask=padding(50), causal=causal, normalize=normalize)
    check_against_reference(lambda *x: kernel(*x, segment_chunks=1, **kw), inputs, kw, 5e-3, 5e-3, rms=True,
                            tol_gate=1e-3)


@pytest.mark.parametrize("gates,causal", [("token", False), ("none", True)])
def test_kernel_float16_scores_past_float16s_range(gates, causal):
    """Scores q.k past float16's 65504 (unnormalised features of about 30 at head size 64, as LION-LIT's
    elu + 1 can reach) stay finite in the in-chunk product with v, as in the PyTorch forms (before: they
    were rounded to float16 operands there, inf, and the output NaN)."""
    q, k, v, f, b = make_inputs(40, gates, D=16, seed=3, dtype=torch.float64)
    q, k = 120 * q, 120 * k  # q.k about 7e4 on average, up to 1.2e5
    assert (q @ k.transpose(-1, -2)).max() > 65504
    inputs = [x.half() for x in (q, k, v)] + [None if x is None else x.float() for x in (f, b)]
    kw = dict(key_padding_mask=padding(40), causal=causal)
    check_against_reference(lambda *x: kernel(*x, segment_chunks=1, **kw), inputs, kw, 5e-3, 5e-3, rms=True,
                            tol_gate=1e-3)


def test_y_kept_as_a_pair_only_for_a_backward(monkeypatch):
    """The second half of y's pair is written at the end of the forward only where a backward will read
    it: not under torch.no_grad (inference, fairseq's validation), where autograd still reports inputs that
    require grad."""
    from lion_fairseq.ops import kernel as kernel_mod

    walks = []

    class Recorded:  # stands in for the forward walk's launches
        def __getitem__(self, grid):
            return lambda *args, **constexprs: walks.append(constexprs)

    monkeypatch.setattr(kernel_mod, "_forward_walk", Recorded())
    q, k, v = (torch.rand(1, 2, 40, 16, dtype=torch.bfloat16, requires_grad=True).to(DEVICE) for _ in range(3))
    gate = -torch.rand(1, 2, 40).to(DEVICE)

    def last_walk_keeps() -> bool:
        kernel_mod.kernel_attention(q, k, v, gate, gate, False, True, None, 1e-6, segment_chunks=1000)
        return walks[-1]["LO_OUT"]

    assert last_walk_keeps()
    with torch.no_grad():
        assert not last_walk_keeps()


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's conversion")
def test_interpreter_rounds_bfloat16_as_a_gpu_does():
    """float32 stored to bfloat16 rounds to nearest (even), as on a GPU, under the patched interpreter
    (unpatched it truncates: twice the error, biased toward zero), so the bfloat16 errors measured here
    are the ones a GPU's stores make."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, tl.load(X + i))

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 4096)
    x[:3] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -7 + 2 ** -9)])  # ties to even, and above one
    y = torch.empty(4096, dtype=torch.bfloat16)
    copy[(1,)](x, y, N=4096)
    assert torch.equal(y, x.to(torch.bfloat16))


@pytest.mark.parametrize("layout", ["fairseq", "expanded gates", "strided head dim"])
def test_kernel_reads_strided_inputs(layout):
    """q, k, v as fairseq's layers hand them over, views of ``(T, B, 3*H*D)`` permuted to ``(B, H, T, D)``,
    and gates expanded from ``(H, 1)`` (stride 0 along L): read in place, the same result. Views whose
    head dim is strided (a transposed ``(B, H, D, T)``, every other column) are copied, as they must be."""
    T, D = 45, 32
    g = torch.Generator().manual_seed(3)
    x = torch.rand(T, B, 3 * H * D, generator=g).to(DEVICE)
    q, k, v = (t.view(T, B, H, D).permute(1, 2, 0, 3) for t in x.split(H * D, -1))
    if layout == "strided head dim":
        q = q.transpose(2, 3).contiguous().transpose(2, 3)
        v = torch.cat([v, v], -1)[..., ::2]
        assert q.stride(-1) != 1 and v.stride(-1) != 1
    assert not q.is_contiguous()
    gate = F.logsigmoid(torch.randn(H, 1, generator=g)).to(DEVICE)
    gates = (gate, gate) if layout == "fairseq" else (gate.expand(B, H, T), gate.expand(B, H, T))
    y = lion_attention(q, k, v, *gates, form="chunk", backend="triton", chunk_size=16)
    ref = lion_attention(q.contiguous(), k.contiguous(), v.contiguous(), gate, gate, form="parallel")
    assert max_err(y, ref, ref.abs().max()) < 1e-5


@pytest.mark.parametrize("gates", ["token", "head"])
def test_gate_gradients_under_strong_decay(gates):
    """Log-gates near -10 and -30 (decays spanning hundreds of e-folds within a chunk): the gates' gradients
    as the reference's, as the PyTorch chunk form gives them (q's and k's are ill-conditioned there, in
    every float32 form, so only the gates are held)."""
    g = torch.Generator().manual_seed(7)
    L = 48
    q, k, v, _, _ = make_inputs(L, "none", D=16, seed=7, dtype=torch.float32)
    w = torch.randn(B, H, L, 16, generator=g, dtype=torch.float64).to(DEVICE)
    shape = (B, H, L) if gates == "token" else (1, H, 1)
    for level in (-10.0, -30.0):
        inputs = [q, k, v] + [(level + 0.5 * torch.tanh(torch.randn(shape, generator=g))).to(DEVICE)
                              for _ in range(2)]
        _, ref = value_and_grads(reference_attention, [x.double() for x in inputs], w)
        _, got = value_and_grads(lambda *x: kernel(*x, chunk_size=16, segment_chunks=2), inputs, w)
        for name, a, r in zip(("log_a_fwd", "log_a_bwd"), got[3:], ref[3:]):
            assert max_err(a, r, r.abs().max()) < 1e-5, (level, name)


def test_kernel_takes_the_archs_head_sizes_and_refuses_larger_ones():
    """32, 64 and 128 (the archs' head sizes) run on the kernel; a larger one is refused, naming the limit
    (and lion_attention then falls back, as the next tests show)."""
    from lion_fairseq.ops.kernel import MAX_HEAD_DIM, kernel_unavailable

    x = torch.zeros(1, device=DEVICE)
    for D in (32, 64, 128):
        assert kernel_unavailable(x, (D, D)) is None, D
    assert f"head sizes up to {MAX_HEAD_DIM}" in kernel_unavailable(x, (64, MAX_HEAD_DIM + 1))


def test_fallbacks_go_triton_to_fla_to_torch(monkeypatch):
    """A kernel that cannot run hands the call to fla where fla can run, else to PyTorch; fla asked for
    where it cannot run (on CPU, say) hands it to PyTorch, with the same result; each says why."""
    backend_mod._warn_once.cache_clear()
    x = torch.zeros(1)
    monkeypatch.setattr(backend_mod, "triton_unavailable", lambda x, dims: "a test's reason")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backend_mod.chunk_backend("triton", x, (32, 32), lambda x: True, lambda x: None) == "fla"
        assert backend_mod.chunk_backend("triton", x, (32, 32), lambda x: False, lambda x: "no fla") == "torch"
    assert ["runs on fla" in str(w.message) for w in caught] == [True, False]
    assert "a test's reason" in str(caught[0].message) and "runs on torch" in str(caught[1].message)
    monkeypatch.undo()
    inputs = make_inputs(20, "token", dtype=torch.float32)
    if torch.cuda.is_available():
        inputs = [t.cpu() for t in inputs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = lion_attention(*inputs, form="chunk", backend="fla", chunk_size=16)
    assert any("flash-linear-attention cannot run here" in str(w.message) for w in caught)
    assert torch.equal(y, lion_attention(*inputs, form="chunk", backend="torch", chunk_size=16))


@pytest.mark.parametrize("gates,causal,dtype", [("token", False, torch.float32), ("head", False, torch.bfloat16),
                                                 ("token", True, torch.float32), ("none", True, torch.float16)])
def test_prefetch_changes_no_value(gates, causal, dtype, monkeypatch):
    """Walks that load the next chunk's tiles ahead (``kernel.PREFETCH``) give the same values and
    gradients, bit for bit, with padding on both sides and segments whose last chunk's successor lies in
    the next segment or past the end (three chunks of 16, two to a segment)."""
    from lion_fairseq.ops import kernel as kmod

    inputs = make_inputs(40, gates, D=16, seed=4, dtype=torch.float32)
    inputs = [x.to(dtype) for x in inputs[:3]] + inputs[3:]
    weight = torch.randn(B, H, 40, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    run = lambda *x: kernel(*x, causal=causal, key_padding_mask=padding(40), segment_chunks=2)  # noqa: E731
    y, g = value_and_grads(run, inputs, weight)
    monkeypatch.setattr(kmod, "PREFETCH", {False: True, True: True})
    y_ahead, g_ahead = value_and_grads(run, inputs, weight)
    assert torch.equal(y, y_ahead)
    for a, r in zip(g_ahead, g):
        assert (a is None) == (r is None) and (r is None or torch.equal(a, r))


def launched(monkeypatch, name):
    """The grids of every launch, from now on, of the kernel module's Triton kernel ``name`` (which still
    runs)."""
    from lion_fairseq.ops import kernel as kmod

    fn, grids = getattr(kmod, name), []

    class Recorded:
        def __getitem__(self, grid):
            grids.append(grid)
            return fn[grid]

    monkeypatch.setattr(kmod, name, Recorded())
    return grids


@pytest.mark.parametrize("gates,dtype", [("token", torch.float16), ("head", torch.bfloat16)])
def test_fused_backward_changes_no_value(gates, dtype, monkeypatch):
    """A bidirectional backward that walks each way once with both of its parts (``kernel.FUSED``, two
    launches; 16-bit inputs) gives the values and gradients of one launch per part (four), bit for bit,
    with padding on both sides and several segments."""
    from lion_fairseq.ops import kernel as kmod

    inputs = make_inputs(40, gates, D=16, seed=6, dtype=torch.float32)
    inputs = [x.to(dtype) for x in inputs[:3]] + inputs[3:]
    weight = torch.randn(B, H, 40, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    run = lambda *x: kernel(*x, key_padding_mask=padding(40), segment_chunks=2)  # noqa: E731
    walks, launches, results = launched(monkeypatch, "_backward_walk"), [], []
    for fused in (False, True):
        monkeypatch.setattr(kmod, "FUSED", {64: fused, 128: fused})
        before = len(walks)
        results.append(value_and_grads(run, inputs, weight))
        launches.append(len(walks) - before)
    assert launches == [4, 2]
    (y, g), (y_fused, g_fused) = results
    assert torch.equal(y, y_fused)
    for a, r in zip(g_fused, g):
        assert (a is None) == (r is None) and (r is None or torch.equal(a, r))


@pytest.mark.parametrize("causal", [False, True])
def test_backward_takes_the_forward_segment_states(causal, monkeypatch):
    """Where the walks are cut into segments (on a GPU: here asked for three per batch and head), the
    backward's walks along a direction take the states entering each segment from the forward's walk in
    that direction, instead of a segment-sum pass of their own: half of the backward's segment-sum
    launches, and the values and gradients of the definition."""
    from lion_fairseq.ops import kernel as kmod

    monkeypatch.setattr(kmod, "_programs", lambda x: 3 * x.shape[0] * x.shape[1])
    launches = launched(monkeypatch, "_segment_sums")
    inputs = make_inputs(70, "token", D=16, seed=7, dtype=torch.float32)
    kw = dict(causal=causal, key_padding_mask=padding(70))
    y = kernel(*[x.detach().requires_grad_() for x in inputs], chunk_size=16, **kw)
    walks = 1 if causal else 2
    assert [grid[1] for grid in launches] == [3] * walks  # the forward's sums, three segments each
    y.sum().backward()
    assert len(launches) == 2 * walks  # the backward's: its walks against each direction only
    check_against_reference(lambda *x: kernel(*x, chunk_size=16, **kw), inputs, kw, 1e-5, 1e-5)


@pytest.mark.parametrize("gates", ["none", "token"])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_slots_holding_inf_or_nan_change_nothing(gates, causal):
    """A padded slot's key and value (an fp16 overflow there, say) contribute nothing, in the segment sums
    and LION-LIT's total state too: the values and gradients equal those with the slots zeroed."""
    L = 53
    q, k, v, f, b = make_inputs(L, gates, seed=3, dtype=torch.float32)
    pad = padding(L)
    spoil = lambda x, value: x.masked_fill(pad[:, None, :, None], value)  # noqa: E731
    weight = torch.randn(B, H, L, v.shape[-1], generator=torch.Generator().manual_seed(1)).double().to(DEVICE)
    fn = lambda *x: kernel(*x, segment_chunks=2, causal=causal, key_padding_mask=pad)  # noqa: E731
    want, want_g = value_and_grads(fn, [q, spoil(k, 0.0), spoil(v, 0.0), f, b], weight)
    got, got_g = value_and_grads(fn, [q, spoil(k, float("inf")), spoil(v, float("nan")), f, b], weight)
    assert torch.isfinite(got).all() and max_err(got, want, want.abs().max()) < 1e-6
    for name, a, r in zip("q k v f b".split(), got_g, want_g):
        if r is not None:
            assert torch.isfinite(a).all() and max_err(a, r, r.abs().max()) < 1e-6, name


@pytest.mark.parametrize("gates", ["none", "token"])
@pytest.mark.parametrize("causal", [False, True])
def test_eps_zero_is_finite_with_gradients(gates, causal):
    """eps = 0 with positive features: the first walk's last row meets no key (0/0), as do the rows past L
    in the last chunk; neither may reach the values or the gradients."""
    inputs = make_inputs(53, gates, seed=5, dtype=torch.float32)
    kw = dict(causal=causal, eps=0.0)
    check_against_reference(lambda *x: kernel(*x, segment_chunks=2, **kw), inputs, kw, 1e-5, 1e-5)


@pytest.mark.parametrize("loss", ["sum", "square"])
def test_a_second_derivative_raises(loss):
    """The kernel's backward is not differentiable: asked for a graph of the gradient (``create_graph``),
    it raises rather than return one that silently misses its terms, from ``y.sum()`` too (whose incoming
    gradient needs none), while a first derivative runs."""
    q, k, v, f, b = (x.requires_grad_() if x is not None else None
                     for x in make_inputs(20, "token", D=16, dtype=torch.float32))
    y = kernel(q, k, v, f, b)
    objective = y.sum() if loss == "sum" else y.pow(2).sum()
    with pytest.raises(RuntimeError, match="differentiate twice through LION's Triton kernel"):
        torch.autograd.grad(objective, q, create_graph=True, retain_graph=True)
    (gq,) = torch.autograd.grad(objective, q)
    assert torch.isfinite(gq).all() and gq.abs().sum() > 0


def test_forward_segment_states_serve_only_the_same_segments():
    """The forward's states serve a backward walk whose segments are the same tokens; walking left, also
    in the same frame, which starts with the last chunk's missing tokens (chunks of 32 forward and of 16
    backward frame L = 70 as 96 and 80 positions, L = 90 as 96 both)."""
    from types import SimpleNamespace

    from lion_fairseq.ops import kernel as kmod

    states = {False: ["right"], True: ["left"]}
    entering = kmod._Entering(tokens=64, padded=96, states=states)
    assert kmod._forward_states(SimpleNamespace(Q=4, C=16, L=70), entering, False) == ["right"]
    assert kmod._forward_states(SimpleNamespace(Q=4, C=16, L=70), entering, True) is None
    assert kmod._forward_states(SimpleNamespace(Q=4, C=16, L=90), entering, True) == ["left"]
    assert kmod._forward_states(SimpleNamespace(Q=3, C=16, L=90), entering, False) is None
    assert kmod._forward_states(SimpleNamespace(Q=4, C=16, L=90), None, False) is None


def test_rows_beyond_32_bit_offsets_are_copied():
    """The kernel adds row offsets in 32 bits: a view of fairseq's layout whose rows reach 2^31 elements
    (64 x 12 heads x 64 at L = 65536) is read from a contiguous copy, one within reach in place."""
    from lion_fairseq.ops import kernel

    def fairseq_view(B, L):
        return torch.empty_strided((B, 12, L, 64), (768, 64, B * 768, 1), device="meta")

    near = fairseq_view(2, 4096)
    assert kernel._addressable(near) is near
    far = kernel._addressable(fairseq_view(64, 65536))
    assert far.stride() == (12 * 65536 * 64, 65536 * 64, 64, 1)


def test_launch_grids_fit_cuda_at_four_million_tokens():
    """CUDA caps a grid's second and third axes at 65535 programs. LION-LIT's passes run a program per
    chunk; at 4.2M tokens, more chunks than that, every launch of LION-LIT's and LION-S's forward and
    backward (recorded, not run: ``kernel_targets``) still fits."""
    from lion_fairseq.ops import kernel as kmod, kernel_targets

    L = 64 * 65535 + 1  # more chunks than 65535 at the interpreter's 64 tokens a chunk, or any fewer
    grids = []
    for gated in (False, True):
        q, k, v = (torch.randn(1, 1, L, 1, requires_grad=True) for _ in range(3))
        f = b = -torch.rand(1, 1, L) if gated else None
        with kernel_targets.recorded(kmod) as launches:
            kmod.kernel_attention(q, k, v, f, b, False, True, None, 1e-6).sum().backward()
        grids += [(launch.kernel, launch.grid) for launch in launches]
    assert {name for name, _ in grids} == set(kernel_targets.LAUNCHED)
    assert all(max(grid[1:], default=1) <= 65535 for _, grid in grids), grids


def test_tf32_is_read_from_either_of_torchs_settings():
    """Whether float32 products run in TF32 follows torch's matmul setting, set the old way (``allow_tf32``)
    or the new (``fp32_precision``, torch >= 2.9, after which reading ``allow_tf32`` raises)."""
    from lion_fairseq.ops.kernel import tf32_matmuls

    matmul = torch.backends.cuda.matmul
    new_way = hasattr(matmul, "fp32_precision")
    before = matmul.fp32_precision if new_way else matmul.allow_tf32
    try:
        for allowed in (True, False):
            matmul.allow_tf32 = allowed
            assert tf32_matmuls() is allowed
        if new_way:
            for precision in ("tf32", "ieee"):
                matmul.fp32_precision = precision
                assert tf32_matmuls() is (precision == "tf32")
    finally:
        if new_way:
            matmul.fp32_precision = before
        else:
            matmul.allow_tf32 = before


def test_tf32_is_read_on_torch_before_2_2(monkeypatch):
    """torch 2.1's ``torch.backends.cuda.matmul`` raised AssertionError, not AttributeError, for a setting it
    does not have (``fp32_precision``): its ``allow_tf32`` still decides."""
    from lion_fairseq.ops.kernel import tf32_matmuls

    class Torch21Matmul:
        def __init__(self, allow_tf32):
            self.__dict__["allowed"] = allow_tf32

        def __getattr__(self, name):
            if name == "allow_tf32":
                return self.allowed
            raise AssertionError("Unknown attribute " + name)

    for allowed in (True, False):
        monkeypatch.setattr(torch.backends.cuda, "matmul", Torch21Matmul(allowed))
        assert tf32_matmuls() is allowed


def test_per_head_gate_gradient_at_long_length():
    """LION-D's gate, one per head and the same tensor for both directions, gets its gradient as
    ``sum_{i>j} (i - j) P_ij`` row by row, not as a sum over L of per-position sums that nearly cancel
    (issue 29): within 1e-5 of float64 at L = 2048, for a strong and a weak decay, across segments. (The
    PyTorch chunk form's float32 gradients of per-token gates, summed over L, are 5.2e-5 off here.)"""
    L = 2048
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.rand(1, H, L, 16, generator=g), torch.rand(1, H, L, 16, generator=g),
               torch.randn(1, H, L, 16, generator=g))
    w = torch.randn(1, H, L, 16, generator=g, dtype=torch.float64).to(DEVICE)
    decays = torch.tensor([[[-1.0], [-0.01]]])  # (1, H, 1): strong and weak

    def gate_grad(fn, dtype):
        gate = decays.to(dtype).to(DEVICE).requires_grad_()
        y = fn(*(x.to(dtype).to(DEVICE) for x in (q, k, v)), gate, gate)
        (y.double() * w).sum().backward()
        return gate.grad.double()

    ref = gate_grad(lambda *x: lion_attention(*x, form="parallel"), torch.float64)
    got = gate_grad(lambda *x: kernel(*x, chunk_size=64, segment_chunks=16), torch.float32)
    assert ((got - ref).abs() / ref.abs()).max().item() < 1e-5


def test_long_strong_decay_stays_finite():
    """Gates near 0 over many chunks and segments (ten and three): every exponent is <= 0, nothing
    overflows."""
    q, k, v, _, _ = make_inputs(600, "none", D=16, dtype=torch.float32)
    gate = torch.full((B, H, 600), -30.0, device=DEVICE, requires_grad=True)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    y = kernel(*leaves, gate, gate, chunk_size=64, segment_chunks=4)
    y.sum().backward()
    assert all(torch.isfinite(t).all() for t in (y, q.grad, k.grad, v.grad, gate.grad))
    # with gates of e^-30 each query sees its own key only
    assert max_err(y, v, v.abs().max()) < 1e-5


def test_backend_argument_and_environment(monkeypatch):
    """``backend=`` and ``LION_BACKEND`` choose; a wrong name is refused naming the option; on CPU the
    default stays the PyTorch chunk form."""
    inputs = make_inputs(40, "token", dtype=torch.float32)
    calls = []
    import lion_fairseq.ops.kernel as kernel_mod

    real = kernel_mod.kernel_attention
    monkeypatch.setattr(kernel_mod, "kernel_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = lion_attention(*inputs, form="chunk", backend="torch", chunk_size=16)
    assert not calls
    y = lion_attention(*inputs, form="chunk", backend="triton", chunk_size=16)
    assert calls and max_err(y, ref, ref.abs().max()) < 1e-5
    calls.clear()
    monkeypatch.setenv("LION_BACKEND", "triton")
    lion_attention(*inputs, form="chunk", chunk_size=16)
    assert calls
    calls.clear()
    lion_attention(*inputs, form="parallel")  # the backend is the chunk form's
    assert not calls
    monkeypatch.setenv("LION_BACKEND", "tritonn")
    with pytest.raises(ValueError, match="LION_BACKEND"):
        lion_attention(*inputs, form="chunk")
    monkeypatch.delenv("LION_BACKEND")
    with pytest.raises(ValueError, match="backend"):
        lion_attention(*inputs, form="chunk", backend="cuda")
    if not torch.cuda.is_available():
        lion_attention(*inputs, form="chunk")
        assert not calls


def test_unavailable_backend_says_why_once_and_falls_back(monkeypatch):
    """float64 is not the kernel's: one warning naming the reason, then the PyTorch chunk form's result."""
    backend_mod._warn_once.cache_clear()
    inputs = make_inputs(20, "head", dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = lion_attention(*inputs, form="chunk", backend="triton")
        lion_attention(*inputs, form="chunk", backend="triton")
    msgs = [str(w.message) for w in caught if "Triton kernel" in str(w.message)]
    assert len(msgs) == 1 and "float64" in msgs[0]
    ref = reference_attention(*inputs)
    assert y.dtype == torch.float64 and max_err(y, ref, ref.abs().max()) < 1e-10


@pytest.mark.parametrize("part", ["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_gpu_without_the_room_falls_back_once(part, dtype, monkeypatch):
    """Triton says only as it loads a kernel onto the GPU that a launch needs more than the GPU has
    (float32 at head size 128 needs 192 KB of shared memory per block: more than an A100 or an L40S has).
    The call says why, once, and gives the PyTorch chunk form's values and gradients; later calls of that
    device, dtype and head size go straight to it."""
    from triton.runtime.errors import OutOfResources

    from lion_fairseq.ops import kernel as kmod

    backend_mod._warn_once.cache_clear()
    monkeypatch.setattr(kmod, "_DOES_NOT_FIT", {})
    calls = []

    def short_of_room(*args, **kwargs):
        calls.append(part)
        raise OutOfResources(196992, 166912, "shared memory")

    monkeypatch.setattr(kmod, f"_{part}", short_of_room)
    inputs = make_inputs(40, "token", dtype=dtype)
    pad = padding(40)
    weight = torch.randn(B, H, 40, inputs[2].shape[-1], generator=torch.Generator().manual_seed(1)).double()
    fn = lambda backend: lambda *x: lion_attention(*x, form="chunk", backend=backend,  # noqa: E731
                                                   key_padding_mask=pad, chunk_size=16)
    want, want_g = value_and_grads(fn("torch"), [x.float() for x in inputs], weight.to(DEVICE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_g = value_and_grads(fn("triton"), inputs, weight.to(DEVICE))
        assert calls == [part]
        value_and_grads(fn("triton"), inputs, weight.to(DEVICE))
    assert calls == [part]  # the second call did not try the kernel again
    msgs = [str(w.message) for w in caught if "Triton kernel" in str(w.message)]
    assert len(msgs) == 1 and "needs 196992 of shared memory per block, and this GPU has 166912" in msgs[0], msgs
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert got.dtype == dtype and max_err(got, want, want.abs().max()) < tol
    for name, a, r in zip("q k v f b".split(), got_g, want_g):
        assert a.dtype == dtype and max_err(a, r, r.abs().max()) < tol, name


def test_mixed_input_dtypes_are_judged_by_the_dtype_they_promote_to():
    """float64 q with float32 k and v: the kernel would read all three as float64, which it does not take;
    it used to judge by v's dtype alone and run its float16 products on them (errors of 3e-4 instead of
    1e-7). Now the call falls back, and the kernel itself refuses mixed or unknown dtypes."""
    backend_mod._warn_once.cache_clear()
    q, k, v, f, b = make_inputs(40, "token")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = lion_attention(q, k.float(), v.float(), f, b, form="chunk", backend="triton", chunk_size=16)
    assert any("float64" in str(w.message) for w in caught if "Triton kernel" in str(w.message))
    ref = reference_attention(q, k.float().double(), v.float().double(), f, b)
    assert y.dtype == torch.float32 and max_err(y, ref, ref.abs().max()) < 1e-5
    with pytest.raises(ValueError, match="one dtype of"):
        kernel(q.float(), k.half(), v.float(), f.float(), b.float())
    with pytest.raises(ValueError, match="one dtype of"):
        kernel(q, k, v, f.float(), b.float())


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_layer_on_the_kernel(variant, monkeypatch):
    """A LionAttention layer (fairseq's ``T x B x C``, padding, gates from its own parameters) gives the same
    output and parameter gradients with ``LION_BACKEND=triton`` as with the PyTorch chunk form."""
    torch.manual_seed(0)
    layer = LionAttention(64, 2, variant, form="chunk", chunk_size=16).to(DEVICE)
    x = torch.randn(37, B, 64, device=DEVICE)
    pad = padding(37)

    def run(backend):
        monkeypatch.setenv("LION_BACKEND", backend)
        layer.zero_grad()
        y = layer(x, key_padding_mask=pad)
        y.pow(2).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}

    y_torch, g_torch = run("torch")
    y_kernel, g_kernel = run("triton")
    assert max_err(y_kernel, y_torch, y_torch.abs().max()) < 1e-5
    for name, g in g_torch.items():
        assert max_err(g_kernel[name], g, g.abs().max()) < 1e-4, name


def test_layer_on_the_kernel_under_torch_compile(monkeypatch):
    """``torch.compile`` of a layer on the kernel (traced by TorchDynamo, the "eager" backend): the kernel's
    call runs as in eager mode, launches and all, where the trace failed before; values and gradients as
    uncompiled."""
    torch.manual_seed(0)
    layer = LionAttention(64, 2, "s", form="chunk", chunk_size=16).to(DEVICE)
    x = torch.randn(37, B, 64, device=DEVICE, requires_grad=True)
    monkeypatch.setenv("LION_BACKEND", "triton")
    walks = launched(monkeypatch, "_forward_walk")
    results = []
    for module in (layer, torch.compile(layer, backend="eager")):
        y = module(x, key_padding_mask=padding(37))
        results.append((y, *torch.autograd.grad(y.pow(2).sum(), [x, *layer.parameters()])))
    torch._dynamo.reset()
    assert len(walks) == 4  # both directions, uncompiled and compiled
    for got, expected in zip(*results):
        assert max_err(got, expected, expected.abs().max()) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_kernel_matches_torch_chunk_form(dtype, tol, causal):
    """The compiled kernel against the PyTorch chunk form on the GPU, relative RMS of the values and of
    every gradient (Triton has miscompiled kernels of this kind before: fla #640)."""
    inputs = make_inputs(3000, "token", D=64, seed=7, dtype=torch.float32)
    inputs = [x.to(dtype) for x in inputs[:3]] + inputs[3:]
    weight = torch.randn(B, H, 3000, 64, device=DEVICE, dtype=torch.float64)
    y, g = value_and_grads(lambda *x: lion_attention(*x, form="chunk", causal=causal, backend="triton"), inputs,
                           weight)
    y_ref, g_ref = value_and_grads(lambda *x: lion_attention(*x, form="chunk", causal=causal, backend="torch"),
                                   inputs, weight)
    rms = lambda a, r: ((a.double() - r.double()).pow(2).mean().sqrt() / r.double().pow(2).mean().sqrt()).item()  # noqa: E731
    assert rms(y, y_ref) < tol
    for name, a, r in zip("q k v log_a_fwd log_a_bwd".split(), g, g_ref):
        if r is not None:
            assert rms(a, r) < tol, name


def test_kernel_targets_says_why_it_cannot_compile(monkeypatch, capsys):
    """With a Triton too old for the kernels (torch < 2.4 ships Triton 2, which has no ``GPUTarget``), the
    compile check stops with the reason, not an ImportError from deep in Triton."""
    from lion_fairseq.ops import backend, kernel_targets

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(backend, "_triton_missing", lambda: "it needs Triton >= 3.0; this is 2.1.0")
    assert kernel_targets.main(["--arch", "90"]) == 2
    assert "cannot be compiled here: it needs Triton >= 3.0; this is 2.1.0" in capsys.readouterr().err


@pytest.mark.parametrize("version, too_old", [("2.3.1", True), ("3.0.0", False), ("3.6.0+git9a8b7c6", False)])
def test_triton_older_than_the_kernels_need_is_named(monkeypatch, version, too_old):
    """Torch < 2.4 ships Triton 2, whose ``tl.dot`` lacks the kernels' ``input_precision``: the kernel then
    says which Triton it found, and a source build's version (``3.6.0+git...``) reads as its numbers."""
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    backend_mod._triton_missing.cache_clear()
    try:
        reason = backend_mod._triton_missing()
    finally:
        backend_mod._triton_missing.cache_clear()
    assert (reason == f"it needs Triton >= 3.0; this is {version}") if too_old else reason is None


def test_kernel_compiles_for_hopper(tmp_path):
    """The interpreter never compiles: LION-S's forward and backward launches (per-token gates both ways,
    key padding, several segments) and its feature map's, bf16 and float32 (three TF32 products each, as with TF32 off),
    compiled by Triton and ptxas for sm_90 (H100/H200), no GPU needed, so a construct only the GPU compiler
    refuses fails here and not on a lent GPU; and none transposes a tensor-core result."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "lion_fairseq.ops.kernel_targets", "--arch", "90", "--head-dims",
                           "64", "--dtypes", "bfloat16", "float32", "--cases", "s"], capture_output=True, text=True,
                          env=dict(env, TRITON_DEFAULT_FP_FUSION="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the table's rows (target, dtype, D, kernel, specialisation, registers, ...), not the summary's
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| sm_90 |")]
    launches = [row for row in rows if len(row) == 12]
    assert {row[4].strip() for row in launches} == {"_segment_sums", "_forward_walk", "_row_grads",
                                                   "_backward_walk", "_silu_norm_forward",
                                                   "_silu_norm_backward"}, proc.stdout
    assert all(int(row[6]) > 0 for row in launches)  # registers read from each binary
    # no tensor-core result is transposed, a pattern Triton 3.4-3.7.0 miscompiled on Hopper (fla #640)
    assert all(int(row[9]) == 0 for row in launches), [(row[4], row[5]) for row in launches if int(row[9])]


def test_log_says_the_kernel_picks_its_own_chunks(caplog):
    """--lion-chunk-size sets the torch backend's chunks; the kernel picks its own (the log said "chunks of 7"
    where it ran 16)."""
    import lion_fairseq.ops.attention as attention_mod

    attention_mod._log_what_runs.cache_clear()
    with caplog.at_level("INFO", logger="lion_fairseq.ops.attention"):
        lion_attention(*make_inputs(20, "head", dtype=torch.float32), form="chunk", backend="triton",
                       chunk_size=7)
    assert "chunk form (triton's own chunks, not --lion-chunk-size's) on triton" in caplog.text, caplog.text
