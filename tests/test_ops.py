"""The three forms of the LION operator against a literal float64 reference (SPEC section 1)."""
import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lion_fairseq.ops import FORMS, causal_state, lion_attention, lion_step
from lion_fairseq.ops import chunk as chunk_module
from reference import fast_reference_attention, reference_attention, reference_mask

C = 8  # chunk size of these tests: small, so that L crosses several chunk borders
B, H, DK, DV = 2, 3, 5, 4


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def make_inputs(L, gates, b=B, h=H, seed=0, dtype=torch.float32):
    """Positive features (as phi gives) for q, k; signed v; log-gates of the requested kind."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, L, DK, generator=g) + 0.05
    k = torch.rand(b, h, L, DK, generator=g) + 0.05
    v = torch.randn(b, h, L, DV, generator=g)
    if gates == "none":
        f = bw = None
    elif gates == "head":  # one gate per head, broadcast over batch and positions
        f = F.logsigmoid(torch.randn(h, 1, generator=g) + 1)
        bw = F.logsigmoid(torch.randn(h, 1, generator=g) + 1)
    else:
        f = F.logsigmoid(torch.randn(b, h, L, generator=g) + 1)
        bw = F.logsigmoid(torch.randn(b, h, L, generator=g) + 1)
    return [x.to(dtype) if x is not None else None for x in (q, k, v, f, bw)]


def grads(fn, inputs, weight):
    """Gradients of ``sum(fn(*inputs) * weight)`` w.r.t. every tensor input."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    (fn(*leaves) * weight.to(leaves[2].dtype)).sum().backward()
    return [x.grad if x is not None else None for x in leaves]


@pytest.mark.parametrize("L", [1, C - 1, C, C + 1, 3 * C + 5])
@pytest.mark.parametrize("gates", ["none", "head", "token"])
@pytest.mark.parametrize("causal,normalize", list(itertools.product([False, True], [True, False])))
def test_forms_equal_reference_with_gradients(L, gates, causal, normalize):
    inputs = make_inputs(L, gates, seed=L)
    weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(1))
    ref_fn = lambda *x: reference_attention(*x, causal=causal, normalize=normalize)  # noqa: E731
    ref = ref_fn(*[x.double() if x is not None else None for x in inputs])
    ref_grads = grads(ref_fn, [x.double() if x is not None else None for x in inputs], weight)
    for form in FORMS:
        fn = lambda *x: lion_attention(*x, form=form, causal=causal, normalize=normalize, chunk_size=C)  # noqa: E731
        y = fn(*inputs)
        assert y.dtype == torch.float32 and y.shape == (B, H, L, DV)
        assert rel_err(y, ref) < 1e-4, form
        for name, g, rg in zip("q k v log_a_fwd log_a_bwd".split(), grads(fn, inputs, weight), ref_grads):
            if rg is None or (causal and name == "log_a_bwd"):
                continue
            assert g is not None, (form, name)
            # an absolute floor: with L = 1 and normalisation, dy/dq is eps-sized and pure round-off
            assert (g.double() - rg).abs().max() <= 1e-3 * rg.abs().max() + 1e-6, (form, name)
            # f_0 and b_{L-1} lie on no path: exactly 0 in the scans (the parallel form's cumulative sums
            # leave round-off there)
            if gates == "token" and name.startswith("log") and form != "parallel":
                assert not g[..., 0 if name == "log_a_fwd" else -1].any(), (form, name)


def test_chunk_longer_than_a_block_of_tokens(monkeypatch):
    """A chunk_size above the chunk form's tokens per block (the contract takes any chunk_size >= 1): one
    chunk a block, values and gradients as the reference's."""
    monkeypatch.setattr(chunk_module, "BLOCK_TOKENS", C // 2)
    assert_chunk_form_matches_reference(make_inputs(2 * C + 3, "token", seed=8), False, C, seed=9)


@pytest.mark.parametrize("steep", [False, True])
@pytest.mark.parametrize("block_tokens", [C, 2 * C, 1 << 30])  # 1 << 30: one block for every head (as on a GPU)
@pytest.mark.parametrize("causal", [False, True])
def test_chunk_form_across_blocks_and_steep_chunks(monkeypatch, steep, block_tokens, causal):
    """Several blocks of chunks (states carried between blocks, both ways), and chunks whose decay is too
    steep for the factored within-chunk decays (log-gates of -30: a span of 240 over 8 tokens), so that
    the exact path runs, in some chunks of a sequence and not in others."""
    monkeypatch.setattr(chunk_module, "BLOCK_TOKENS", block_tokens)
    L = 5 * C + 3
    inputs = make_inputs(L, "token", seed=3)
    if steep:
        for gate in inputs[3:]:
            gate[..., 2 * C:3 * C] = -30.0
    assert_chunk_form_matches_reference(inputs, causal, C, seed=2)


def assert_chunk_form_matches_reference(inputs, causal, chunk_size, seed):
    """The chunk form's values and gradients (of a random weighting of its output) against the float64
    reference."""
    B_, H_, L = inputs[0].shape[:3]
    weight = torch.randn(B_, H_, L, inputs[2].shape[-1], generator=torch.Generator().manual_seed(seed))
    ref_fn = lambda *x: reference_attention(*x, causal=causal)  # noqa: E731
    ref_inputs = [x.double() for x in inputs]
    ref, ref_grads = ref_fn(*ref_inputs), grads(ref_fn, ref_inputs, weight)
    fn = lambda *x: lion_attention(*x, form="chunk", causal=causal, chunk_size=chunk_size)  # noqa: E731
    assert rel_err(fn(*inputs), ref) < 1e-4
    for name, g, rg in zip("q k v log_a_fwd log_a_bwd".split(), grads(fn, inputs, weight), ref_grads):
        if causal and name == "log_a_bwd":
            continue
        assert (g.double() - rg).abs().max() <= 1e-3 * rg.abs().max() + 1e-6, name


@pytest.mark.parametrize("chunk", [2 * chunk_module.SUB, 2 * chunk_module.SUB + 3])
@pytest.mark.parametrize("causal", [False, True])
def test_chunk_form_trains_with_chunks_of_several_sub_blocks(chunk, causal):
    """Chunks of several sub-blocks of decays, a whole number of them or not (then the decay matrix is
    cropped before the backward pass keeps it): values and gradients against the reference."""
    assert_chunk_form_matches_reference(make_inputs(3 * chunk + 5, "token", seed=5), causal, chunk, seed=6)


def test_chunk_workspace_is_per_thread_and_can_be_released():
    """The chunk form's reused buffers: calls of other shapes in between, other threads at the same
    time, or a release change no value or gradient."""
    import threading

    from lion_fairseq.ops import release_workspace

    def run(L, seed):
        x = [t.requires_grad_() for t in make_inputs(L, "token", seed=seed)]
        y = lion_attention(*x, form="chunk", chunk_size=C)
        y.pow(2).sum().backward()
        return [y.detach()] + [t.grad for t in x]

    release_workspace()
    alone = {L: run(L, L) for L in (3 * C + 1, 7 * C)}
    results = {}

    def worker(L):
        results[L] = [run(L, L) for _ in range(3)]

    threads = [threading.Thread(target=worker, args=(L,)) for L in alone]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from lion_fairseq.ops.workspace import workspace

    assert workspace.named and workspace.kept_bufs  # what a training call leaves to reuse ...
    release_workspace()
    assert not workspace.named and not workspace.kept_bufs  # ... freed, the buffers kept for backward too
    after = {L: run(L, L) for L in alone}
    for L, expect in alone.items():
        for got in results[L] + [after[L]]:
            for a, b in zip(got, expect):
                assert torch.equal(a, b), L


def test_chunk_buffers_kept_for_backward_are_not_reused_while_held():
    """What the forward keeps for the backward pass comes from reused buffers: two graphs alive at once,
    and a graph kept (``retain_graph``) across another step, each get gradients of their own."""
    def leaves(seed):
        return [t.requires_grad_() for t in make_inputs(4 * C + 3, "token", seed=seed)]

    def alone(seed):
        x = leaves(seed)
        lion_attention(*x, form="chunk", chunk_size=C).pow(2).sum().backward()
        return [t.grad for t in x]

    expect = {seed: alone(seed) for seed in (1, 2)}
    x1, x2 = leaves(1), leaves(2)
    y1 = lion_attention(*x1, form="chunk", chunk_size=C).pow(2).sum()
    y2 = lion_attention(*x2, form="chunk", chunk_size=C).pow(2).sum()
    (y1 + y2).backward(retain_graph=True)
    alone(2)  # a step in between, which may take any buffer not held
    y1.backward()  # the kept graph again: its gradients add up a second time
    for got, want in zip([t.grad for t in x1], expect[1]):
        assert torch.allclose(got, 2 * want, rtol=1e-5, atol=1e-6)
    for got, want in zip([t.grad for t in x2], expect[2]):
        assert torch.equal(got, want)


def test_chunk_buffers_held_through_their_storage_only_are_not_reused():
    """A saved-tensor hook that keeps only a kept buffer's storage (as offloading and memory-saving tools
    do), then another call before the first one's backward: the buffers stay with the first graph until
    it is gone, so its gradients are its own (issue 29: relative errors of 2.8 and 0.12 before)."""
    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.rand(1, 2, 64, 8, generator=g).requires_grad_() for _ in range(3)]

    def pack(t):
        return t.untyped_storage(), t.storage_offset(), t.shape, t.stride(), t.dtype

    def unpack(p):
        return torch.empty(0, dtype=p[4]).set_(p[0], p[1], p[2], p[3])

    x = inputs(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = lion_attention(*x, form="chunk", chunk_size=16)
    lion_attention(*inputs(1), form="chunk", chunk_size=16).sum().backward()
    y.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in x]
    lion_attention(*ref, form="parallel").sum().backward()
    for a, r in zip(x, ref):
        assert rel_err(a.grad, r.grad) < 1e-5


@pytest.mark.parametrize("form", FORMS)
def test_per_head_gate_gradient_at_long_length(form):
    """LION-D's gate, one per head and the same tensor for both directions, at L = 4096 (the largest the
    suite affords; the float64 reference holds L x L matrices): its gradient within 1e-5 of float64 for a
    strong (log-gate -1) and a weak (-0.01) decay in every form. Summed over L as per-position sums of
    rows minus columns, the chunk form's was 3.9e-4 off here (issue 29); it is summed pair by pair."""
    L = 4096
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.rand(1, 2, L, 16, generator=g), torch.rand(1, 2, L, 16, generator=g), torch.randn(1, 2, L, 16, generator=g)
    w = torch.randn(1, 2, L, 16, generator=g, dtype=torch.float64)
    decays = torch.tensor([[-1.0], [-0.01]])

    def gate_grad(fn, dtype):
        gate = decays.to(dtype).requires_grad_()
        (fn(q.to(dtype), k.to(dtype), v.to(dtype), gate, gate).double() * w).sum().backward()
        return gate.grad.double()

    ref = gate_grad(fast_reference_attention, torch.float64)
    got = gate_grad(lambda *x: lion_attention(*x, form=form), torch.float32)
    assert ((got - ref).abs() / ref.abs()).max().item() < 1e-5


@pytest.mark.parametrize("gates", ["head", "token"])
@pytest.mark.parametrize("causal,normalize", [(False, False), (False, True), (True, False)])
def test_gate_gradients_under_strong_decay(gates, causal, normalize):
    """Log-gates of -10 and -30 (each token forgets nearly all before it): the gates' gradients within
    1e-5 of float64 in every form, relative to their largest entry (itself 1e-4 and 1e-12 here). The
    diagonal crosses no gate; taken into the chunk form's row and column sums, or into the parallel
    form's mask as F_i - F_i, it cancelled only to its own rounding, which outweighs every other pair:
    the chunk form's gradients were up to 1e-2 off here at -10 and 0.6 at -30, the parallel form's 2e-3
    to 1.5e-2 at -30 (L = 64)."""
    L = 3 * C + 5
    for log_gate in (-10.0, -30.0):
        q, k, v, f, bw = make_inputs(L, gates, seed=3)
        f, bw = log_gate + 0.5 * torch.tanh(f), log_gate + 0.5 * torch.tanh(bw)
        inputs = [q, k, v, f, bw]
        weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(1))
        ref_fn = lambda *x: reference_attention(*x, causal=causal, normalize=normalize)  # noqa: E731
        ref = grads(ref_fn, [x.double() for x in inputs], weight)
        for form in FORMS:
            got = grads(lambda *x: lion_attention(*x, form=form, causal=causal, normalize=normalize, chunk_size=C),
                        inputs, weight)
            for name, g, r in zip(("log_a_fwd", "log_a_bwd"), got[3:], ref[3:]):
                if not (causal and name == "log_a_bwd"):
                    assert rel_err(g, r) < 1e-5, (log_gate, form, name)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(form, causal):
    q, k, v, f, b = make_inputs(6, "token", b=1, h=2, dtype=torch.float64)
    inputs = tuple(x.requires_grad_() for x in (q, k, v, f, b))
    fn = lambda *x: lion_attention(*x, form=form, causal=causal, chunk_size=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_reference_cumsum_twin_matches_literal_products():
    for causal in (False, True):
        inputs = make_inputs(11, "token", dtype=torch.float64)
        assert rel_err(fast_reference_attention(*inputs, causal=causal), reference_attention(*inputs, causal=causal)) < 1e-12


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_on_either_side_changes_nothing(form, causal):
    L, P = 11, 5
    q, k, v, f, b = make_inputs(L, "token", b=1)
    alone = lion_attention(q, k, v, f, b, form=form, causal=causal, chunk_size=4)
    junk = make_inputs(P, "token", b=1, seed=7)
    for side in ("right", "left"):
        cat = (lambda x, j: torch.cat([x, j], 2)) if side == "right" else (lambda x, j: torch.cat([j, x], 2))
        padded = [cat(x, j) for x, j in zip((q, k, v, f, b), junk)]
        mask = torch.zeros(1, L + P, dtype=torch.bool)
        real = slice(0, L) if side == "right" else slice(P, L + P)
        mask[:, slice(L, L + P) if side == "right" else slice(0, P)] = True
        # a second row, unpadded, makes it a batch whose rows need different masks
        other = make_inputs(L + P, "token", b=1, seed=3)
        batch = [torch.cat([x, o], 0) for x, o in zip(padded, other)]
        mask = torch.cat([mask, torch.zeros_like(mask)], 0)
        y = lion_attention(*batch, form=form, causal=causal, key_padding_mask=mask, chunk_size=4)
        assert torch.isfinite(y).all()
        assert rel_err(y[:1, :, real], alone) < 1e-5, side
        assert rel_err(y[1:], lion_attention(*other, form=form, causal=causal, chunk_size=4)) < 1e-5


def _spoil_padding(x, mask, value):
    """x ``(B, H, L, D)`` with ``value`` at the positions ``mask`` ``(B, L)`` pads."""
    return x.masked_fill(mask[:, None, :, None], value)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
def test_padded_slots_holding_inf_or_nan_change_nothing(form, causal):
    """A padded slot's key and value (an fp16 overflow there, say) contribute nothing: the values and
    gradients equal those with the slots zeroed, and are finite."""
    L = 3 * C + 5
    q, k, v, f, b = make_inputs(L, "token")
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, L - 6:], mask[1, :4] = True, True
    weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(1))
    fn = lambda *x: lion_attention(*x, form=form, causal=causal, key_padding_mask=mask, chunk_size=C)  # noqa: E731
    clean = [_spoil_padding(k, mask, 0.0), _spoil_padding(v, mask, 0.0)]
    spoilt = [_spoil_padding(k, mask, float("inf")), _spoil_padding(v, mask, float("nan"))]
    want, got = fn(q, *clean, f, b), fn(q, *spoilt, f, b)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-6
    for name, a, r in zip("q k v f b".split(), grads(fn, [q, *spoilt, f, b], weight), grads(fn, [q, *clean, f, b], weight)):
        if r is not None:
            assert torch.isfinite(a).all() and rel_err(a, r) < 1e-5, name


@pytest.mark.parametrize("eps", [0.0, 0.5])
@pytest.mark.parametrize("causal", [False, True])
def test_eps_enters_as_defined_and_zero_is_finite(causal, eps):
    """``y_i = sum_j A_ij v_j / (sum_j A_ij + eps)`` for the eps given (0.5 moves rows by a few percent:
    a form that kept its own eps fails), and with eps = 0 the definition is finite for positive features:
    every form agrees with it, values and gradients, where L is not a multiple of the chunk (whose padding
    rows have no key: 0/0). The decoding step does the same."""
    L = 3 * C + 5
    inputs = make_inputs(L, "token", seed=2)
    weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(1))
    double = [x.double() for x in inputs]
    ref_fn = lambda *x: reference_attention(*x, causal=causal, eps=eps)  # noqa: E731
    ref, ref_grads = ref_fn(*double), grads(ref_fn, double, weight)
    assert rel_err(reference_attention(*double, causal=causal), ref) > 1e-2 or eps == 0
    for form in FORMS:
        fn = lambda *x: lion_attention(*x, form=form, causal=causal, eps=eps, chunk_size=C)  # noqa: E731
        assert rel_err(fn(*inputs), ref) < 1e-5, form
        for name, a, r in zip("q k v f b".split(), grads(fn, inputs, weight), ref_grads):
            if not (causal and name == "b"):
                assert torch.isfinite(a).all() and rel_err(a, r) < 1e-4, (form, name)
    if causal:
        q, k, v, f, _ = inputs
        state, ys = None, []
        for t in range(L):
            y_t, state = lion_step(q[:, :, t], k[:, :, t], v[:, :, t], f[..., t], state, eps=eps)
            ys.append(y_t)
        assert rel_err(torch.stack(ys, 2), ref) < 1e-5


@pytest.mark.parametrize("loss", ["sum", "square"])
def test_a_second_derivative_raises_where_a_form_cannot_give_it(loss):
    """The chunk form's backward is its own code, not differentiable: asked for a graph of the gradient
    (a gradient penalty), it raises, rather than return a gradient that silently misses its terms. From
    ``y.sum()`` the incoming gradient needs none, where ``once_differentiable`` alone let it through. The
    parallel and recurrent forms give the second derivative, and agree."""
    q, k, v, f, b = (x.requires_grad_() for x in make_inputs(2 * C, "token"))
    penalties = {}
    for form in FORMS:
        y = lion_attention(q, k, v, f, b, form=form, chunk_size=C)
        objective = y.sum() if loss == "sum" else y.pow(2).sum()
        if form == "chunk":
            with pytest.raises(RuntimeError, match="differentiate twice through the chunk form.*form='parallel'"):
                torch.autograd.grad(objective, q, create_graph=True)
            continue
        (gq,) = torch.autograd.grad(objective, q, create_graph=True)
        penalties[form] = torch.autograd.grad(gq.pow(2).sum(), k)[0]
        assert torch.isfinite(penalties[form]).all() and penalties[form].abs().sum() > 0, form
    assert rel_err(penalties["recurrent"], penalties["parallel"]) < 1e-6


def test_torch_func_transforms_run_where_the_readme_says():
    """``torch.func.grad`` and ``vmap`` in the parallel and recurrent forms (the README's word) give
    autograd's gradient and the unbatched values; the chunk form's autograd.Function refuses them."""
    q, k, v, f, b = make_inputs(2 * C, "token")
    for form in FORMS:
        def loss(q, form=form):
            return lion_attention(q, k, v, f, b, form=form, chunk_size=C).pow(2).sum()

        if form == "chunk":
            with pytest.raises(RuntimeError, match="setup_context"):
                torch.func.grad(loss)(q)
            continue
        q1 = q.clone().requires_grad_()
        torch.testing.assert_close(torch.func.grad(loss)(q), torch.autograd.grad(loss(q1), q1)[0])
        one = lambda *x: lion_attention(*(t[None] for t in x), form=form)[0]  # noqa: E731
        torch.testing.assert_close(torch.func.vmap(one)(q, k, v, f, b), lion_attention(q, k, v, f, b, form=form))


def test_recurrent_form_backward_work_grows_linearly_with_length():
    """The recurrent form trains through a token loop. Under autograd, a slice per token of its inputs (and a
    write per token into one output) cost the backward a full-length gradient each: O(L^2), 15 s at
    L = 8000 where the linear loop takes 2.5 s. Counted, not timed: the elements the backward's ops write,
    at L and 2L, with gates per token and per head."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Written(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.elements += sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            return out

    def work(L: int, gates: str) -> int:
        inputs = [x.requires_grad_() if x is not None else None for x in make_inputs(L, gates)]
        y = lion_attention(*inputs, form="recurrent")
        with Written() as written:
            y.pow(2).sum().backward()
        return written.elements

    for gates in ("token", "head"):
        assert work(128, gates) / work(64, gates) < 2.2, gates


def test_long_sequence_strong_decay_stays_finite_and_forms_agree():
    L = 16384
    g = torch.Generator().manual_seed(0)
    q, k = torch.rand(1, 2, L, 8, generator=g), torch.rand(1, 2, L, 8, generator=g)
    v = torch.randn(1, 2, L, 8, generator=g)
    gate = torch.full((1, 2, L), -5.0)
    with torch.no_grad():
        chunk = lion_attention(q, k, v, gate, gate, form="chunk")
        rec = lion_attention(q, k, v, gate, gate, form="recurrent")
    assert torch.isfinite(chunk).all() and torch.isfinite(rec).all()
    assert rel_err(chunk, rec) < 1e-4
    n = 2048
    ref = fast_reference_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], gate[..., :n], gate[..., :n])
    for form in FORMS:
        with torch.no_grad():
            y = lion_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], gate[..., :n], gate[..., :n], form=form)
        assert rel_err(y, ref) < 1e-4, form


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_inputs_in_every_form_and_step(causal):
    """bfloat16 in, bfloat16 out (v's dtype), computed in float32: every form, and the decoding step, whose
    state stays float32."""
    inputs = make_inputs(3 * C + 5, "token", dtype=torch.bfloat16)
    ref = reference_attention(*[x.double() for x in inputs], causal=causal)
    rms = lambda x: x.double().pow(2).mean().sqrt()  # noqa: E731
    for form in FORMS:
        y = lion_attention(*inputs, form=form, causal=causal, chunk_size=C)
        assert y.dtype == torch.bfloat16, form
        assert rms(y.double() - ref) / rms(ref) < 1e-2, form
    if causal:
        q, k, v, f, _ = inputs
        y_t, (S, z) = lion_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], f[..., 0])
        assert y_t.dtype == torch.bfloat16 and S.dtype == z.dtype == torch.float32


@pytest.mark.parametrize("L", [1, 3 * C + 5])
@pytest.mark.parametrize("gates", ["none", "head", "token"])
@pytest.mark.parametrize("causal,normalize", list(itertools.product([False, True], [True, False])))
def test_bfloat16_matmuls_stay_near_the_reference(L, gates, causal, normalize):
    """matmul_dtype=bfloat16 (inference): bfloat16 products, float32 sums, states and normalisers."""
    inputs = make_inputs(L, gates, seed=L)
    ref = reference_attention(*[x.double() if x is not None else None for x in inputs], causal=causal,
                              normalize=normalize)
    with torch.no_grad():
        y = lion_attention(*inputs, form="chunk", causal=causal, normalize=normalize, chunk_size=C,
                           matmul_dtype=torch.bfloat16)
        full = lion_attention(*inputs, form="chunk", causal=causal, normalize=normalize, chunk_size=C)
    assert y.dtype == torch.float32 and y.shape == (B, H, L, DV)
    rms = lambda x: x.double().pow(2).mean().sqrt()  # noqa: E731
    assert rms(y.double() - ref) / rms(ref) < 1e-2
    assert rel_err(y, ref) < 3e-2
    assert rel_err(full, ref) < 1e-5 < rel_err(y, ref)  # the products were bfloat16, the default's are not


def test_bfloat16_matmuls_only_where_nothing_is_trained():
    """With inputs that need gradients (or the parallel form) matmul_dtype=bfloat16 computes in float32,
    exactly as the default; long strong-decay sequences stay finite in bfloat16 and agree with float32."""
    q, k, v, f, b = make_inputs(3 * C + 5, "token")
    q.requires_grad_()
    y = lion_attention(q, k, v, f, b, form="chunk", chunk_size=C, matmul_dtype=torch.bfloat16)
    assert torch.equal(y, lion_attention(q, k, v, f, b, form="chunk", chunk_size=C))
    with torch.no_grad():
        par = lion_attention(q, k, v, f, b, form="parallel", matmul_dtype=torch.bfloat16)
        assert torch.equal(par, lion_attention(q, k, v, f, b, form="parallel"))
    L = 8192
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.rand(1, 2, L, 8, generator=g), torch.rand(1, 2, L, 8, generator=g), torch.randn(1, 2, L, 8, generator=g)
    gate = torch.full((1, 2, L), -5.0)
    with torch.no_grad():
        low = lion_attention(q, k, v, gate, gate, form="chunk", matmul_dtype=torch.bfloat16)
        full = lion_attention(q, k, v, gate, gate, form="chunk")
    assert torch.isfinite(low).all() and rel_err(low, full) < 3e-2
    with pytest.raises(ValueError, match="matmul_dtype"):
        lion_attention(q, k, v, form="chunk", matmul_dtype=torch.float16)
    # gates that are trained (with q, k and v fixed) need gradients too: float32, as the default
    q, k, v, f, b = make_inputs(3 * C + 5, "token")
    grad = {}
    for dtype in (torch.bfloat16, None):
        gate = f.clone().requires_grad_()
        lion_attention(q, k, v, gate, b, form="chunk", chunk_size=C, matmul_dtype=dtype).pow(2).sum().backward()
        grad[dtype] = gate.grad
    assert torch.equal(grad[torch.bfloat16], grad[None])


@pytest.mark.parametrize("gates", ["none", "head", "token"])
@pytest.mark.parametrize("normalize", [True, False])
def test_token_by_token_step_equals_causal_form(gates, normalize):
    L = 2 * C + 3
    q, k, v, f, _ = make_inputs(L, gates)
    full = lion_attention(q, k, v, f, form="chunk", causal=True, normalize=normalize, chunk_size=C)
    state, ys = None, []
    for t in range(L):
        f_t = None if f is None else f.expand(B, H, L)[..., t]
        y_t, state = lion_step(q[:, :, t], k[:, :, t], v[:, :, t], f_t, state, normalize=normalize)
        ys.append(y_t)
        if t == 0:
            first = state
    assert rel_err(torch.stack(ys, 2), full) < 1e-5
    # one-token slices in the operator's layout (B, H, 1, D) step the same
    state4, ys4 = None, []
    for t in range(L):
        f_t = None if f is None else f.expand(B, H, L)[..., t:t + 1]
        y_t, state4 = lion_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], f_t, state4,
                                normalize=normalize)
        ys4.append(y_t)
    assert torch.equal(torch.cat(ys4, 2), torch.stack(ys, 2)) and torch.equal(state4[0], state[0])
    if f is not None:  # a (B, H, 1) gate steps (B, H, D) tokens too, as the docstring says
        y_t, _ = lion_step(q[:, :, 1], k[:, :, 1], v[:, :, 1], f.expand(B, H, L)[..., 1:2], first, normalize=normalize)
        assert torch.equal(y_t, ys[1])
    # the state after the loop is what causal_state gives in one pass, also behind padding
    S, z = causal_state(k, v, f)
    assert rel_err(S, state[0]) < 1e-5 and rel_err(z, state[1]) < 1e-5
    assert state[0].shape == (B, H, DK, DV) and state[1].shape == (B, H, DK)
    junk = make_inputs(4, gates, seed=9)
    mask = torch.zeros(B, L + 4, dtype=torch.bool)
    mask[:, :4] = True
    f_pad = None if f is None else torch.cat([junk[3].expand(B, H, 4), f.expand(B, H, L)], -1)
    S_left, _ = causal_state(torch.cat([junk[1], k], 2), torch.cat([junk[2], v], 2), f_pad, mask)
    assert rel_err(S_left, state[0]) < 1e-5
    # padding after the tokens (a right-padded prompt) neither adds to the state nor decays it
    f_pad = None if f is None else torch.cat([f.expand(B, H, L), junk[3].expand(B, H, 4)], -1)
    S_right, _ = causal_state(torch.cat([k, junk[1]], 2), torch.cat([v, junk[2]], 2), f_pad, mask.flip(1))
    assert rel_err(S_right, state[0]) < 1e-5


def zero_gates(log_a: torch.Tensor) -> torch.Tensor:
    """``log_a`` ``(B, H, L)`` with the gates at positions 2 and 5 exactly 0 (log-gate -inf)."""
    log_a = log_a.clone()
    log_a[:, :, [2, 5]] = float("-inf")
    return log_a


def reference_state(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor):
    """``(sum_j w_j k_j v_j^T, sum_j w_j k_j)`` in float64, with weights w ``(B, H, L)`` (a row of the mask)."""
    kw = k.double() * w[..., None]
    return kw.transpose(-1, -2) @ v.double(), kw.sum(-2)


def test_memory_read_is_bidirectional_attention_without_decay():
    """Cross-attention's memory (``memory_state``, then ``read_memory``) is lion_attention with no gates over
    the memory's keys, the eps given included, padded keys left out."""
    from lion_fairseq.ops.memory import memory_state, read_memory

    q, k, v, _, _ = make_inputs(9, "none", seed=4)
    mask = torch.zeros(B, 9, dtype=torch.bool)
    mask[1, -3:] = True
    for eps, normalize in ((0.5, True), (1e-6, True), (1e-6, False)):
        y = read_memory(q, memory_state(k, v, mask), normalize=normalize, eps=eps)
        ref = reference_attention(q.double(), k.double(), v.double(), normalize=normalize, eps=eps,
                                  key_padding_mask=mask)
        assert rel_err(y, ref) < 1e-5, (eps, normalize)


def test_step_takes_lion_attentions_per_head_gate_as_one_per_head():
    """A per-head gate ``(H, 1)``, as lion_attention takes it, was read against ``(B, H)`` as one gate per batch
    row where B == H (and refused where not): decoding went wrong without a word."""
    q, k, v, f, _ = make_inputs(9, "head", b=2, h=2)
    assert f.shape == (2, 1)
    ref = lion_attention(q, k, v, f, form="recurrent", causal=True)
    state = None
    for t in range(9):
        y_t, state = lion_step(q[:, :, t], k[:, :, t], v[:, :, t], f, state)
        torch.testing.assert_close(y_t, ref[:, :, t], atol=1e-5, rtol=1e-5)
    S, z = causal_state(k, v, f)
    torch.testing.assert_close(state[0], S, atol=1e-5, rtol=1e-5)
    q3, k3, v3, f3, _ = make_inputs(9, "head", b=3, h=2)  # B != H: it was refused, now taken alike
    y_t, _ = lion_step(q3[:, :, 1], k3[:, :, 1], v3[:, :, 1], f3, lion_step(q3[:, :, 0], k3[:, :, 0], v3[:, :, 0])[1])
    torch.testing.assert_close(y_t, lion_attention(q3, k3, v3, f3, form="recurrent", causal=True)[:, :, 1],
                               atol=1e-5, rtol=1e-5)


def test_causal_state_refuses_what_lion_attention_refuses():
    """It took a transposed mask as (B, L) and returned one state per position, integer keys, and failed
    on other shapes with torch's or Python's words."""
    _, k, v, f, _ = make_inputs(5, "token", b=2)
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor of shape \(B, L\) = \(2, 5\)"):
        causal_state(k, v, f, torch.zeros(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor"):
        causal_state(k, v, f, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="k must be a floating-point tensor"):
        causal_state(k.long(), v, f)
    with pytest.raises(ValueError, match=r"k must be \(B, H, L, Dk\) and v"):
        causal_state(k[0], v[0], f)
    with pytest.raises(ValueError, match=r"k must be \(B, H, L, Dk\) and v"):
        causal_state(k, v[:, :, :4], f)
    with pytest.raises(ValueError, match="log_a_fwd must be broadcastable"):
        causal_state(k, v, f[..., :4])
    mask = torch.tensor([[1, 0, 0, 0, 0], [0, 0, 0, 1, 1]])  # an integer mask: the bool one it stands for
    assert all(torch.equal(a, b) for a, b in zip(causal_state(k, v, f, mask), causal_state(k, v, f, mask.bool())))


def test_causal_state_takes_a_gate_of_zero_as_lion_attention_does():
    """A log-gate of -inf is floored as ``lion_attention`` floors it: no -inf - -inf in the suffix sums."""
    _, k, v, f, _ = make_inputs(7, "token", seed=3)
    f = zero_gates(f)
    S, z = causal_state(k, v, f)
    assert torch.isfinite(S).all() and torch.isfinite(z).all()
    S_floor, z_floor = causal_state(k, v, f.clamp(min=-1e4))
    assert torch.equal(S, S_floor) and torch.equal(z, z_floor)
    gate = f.double().exp()
    S_ref, z_ref = reference_state(k, v, reference_mask(gate, gate, causal=True)[..., -1, :])
    assert rel_err(S, S_ref) < 1e-6 and rel_err(z, z_ref) < 1e-6


@pytest.mark.parametrize("shape", [(0, 2, 5, 4), (2, 0, 5, 4), (2, 2, 0, 4)])
@pytest.mark.parametrize("form", FORMS)
def test_empty_batch_heads_or_length_give_an_empty_output(form, shape):
    """B, H or L of 0: an empty output of v's shape and dtype whose backward runs, in every form (the chunk
    form divided by zero at L = 0, the recurrent form's backward failed, the kernel at B or H = 0)."""
    q, k, v = (torch.rand(shape, requires_grad=True) for _ in range(3))
    f = torch.zeros(shape[:3])
    y = lion_attention(q, k, v, f, f, form=form, key_padding_mask=torch.zeros(shape[0], shape[2], dtype=torch.bool))
    assert y.shape == shape and y.dtype == v.dtype
    y.sum().backward()


def test_bad_arguments_name_the_argument():
    q, k, v, f, b = make_inputs(5, "token")
    with pytest.raises(ValueError, match="form"):
        lion_attention(q, k, v, form="fft")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            lion_attention(q, k, v, form="chunk", chunk_size=bad)
    # numpy's integers are integers
    assert torch.equal(lion_attention(q, k, v, f, b, form="chunk", chunk_size=np.int64(4)),
                       lion_attention(q, k, v, f, b, form="chunk", chunk_size=4))
    with pytest.raises(ValueError, match="k must"):
        lion_attention(q, k[:, :, :4], v)
    with pytest.raises(ValueError, match="v must"):
        lion_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="q must"):
        lion_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="log_a_fwd"):
        lion_attention(q, k, v, f[..., :4])
    for form in FORMS:  # every form, causal too, where the backward gate is not used
        for causal in (False, True):
            with pytest.raises(ValueError, match="log_a_bwd"):
                lion_attention(q, k, v, f, b[:1, :2], form=form, causal=causal)
    with pytest.raises(ValueError, match="key_padding_mask"):
        lion_attention(q, k, v, key_padding_mask=torch.zeros(B, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):  # an additive float mask is not a padding mask
        lion_attention(q, k, v, key_padding_mask=torch.zeros(B, 5))
    # a byte mask (older fairseq's) is taken as the bool mask it stands for
    mask = torch.tensor([[1, 0, 0, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    for form in FORMS:
        assert torch.equal(lion_attention(q, k, v, f, b, form=form, key_padding_mask=mask.to(torch.uint8)),
                           lion_attention(q, k, v, f, b, form=form, key_padding_mask=mask))
    with pytest.raises(ValueError, match="state"):
        lion_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, (torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1)))
    with pytest.raises(ValueError, match=r"state must be the pair \(S, z\)"):  # not a bare unpacking error
        lion_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, (torch.zeros(1, 1, 1, 1),))
    _, state = lion_step(q[:, :, 0], k[:, :, 0], v[:, :, 0])
    with pytest.raises(ValueError, match="log_a_t"):
        lion_step(q[:, :, 1], k[:, :, 1], v[:, :, 1], f[:, :, :2], state)
    # integer inputs would be computed in float and cast back, truncated: refused by name, as are gates that
    # are no float tensor
    for name in ("q", "k", "v"):
        args = {"q": q, "k": k, "v": v, name: torch.ones(q.shape[:3] + (v.shape[-1] if name == "v" else q.shape[-1],),
                                                         dtype=torch.long)}
        with pytest.raises(ValueError, match=f"{name} must be a floating-point tensor"):
            lion_attention(**args)
        with pytest.raises(ValueError, match=f"{name}_t must be a floating-point tensor"):
            lion_step(*(args[n][:, :, 0] for n in "qkv"))
    for eps in (-1e-6, float("nan"), float("inf"), None, True):  # a negative eps can cancel a row sum to zero
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            lion_attention(q, k, v, eps=eps)
        with pytest.raises(ValueError, match="eps must be"):
            lion_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], eps=eps)
    assert torch.isfinite(lion_attention(q, k, v, f, b, eps=0)).all()
    for gate in (-0.5, f.long(), f < 0):
        with pytest.raises(ValueError, match="log_a_fwd must be a float tensor"):
            lion_attention(q, k, v, gate)
        with pytest.raises(ValueError, match="log_a_t must be a float tensor"):
            lion_step(q[:, :, 1], k[:, :, 1], v[:, :, 1], gate if isinstance(gate, float) else gate[..., 1], state)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("decay", [False, True])
def test_chunk_scan_equals_the_sum_it_stands_for(reverse, decay, in_place):
    """The scan over the chunk axis (the states entering each chunk, and their gradients) against the
    literal sum ``sum_{j<m} (prod_{j<l<m} whole_l) U_j`` (``j > m`` when ``reverse``)."""
    g = torch.Generator().manual_seed(4)
    N, G = 7, 3
    U = torch.randn(G, N, 4, 5, generator=g, dtype=torch.float64)
    whole = torch.rand(G, N, generator=g, dtype=torch.float64) if decay else None
    x = U.clone() if in_place else torch.full_like(U, float("nan"))  # every entry written
    chunk_module.scan(x if in_place else U, x, whole, reverse)
    for m in range(N):
        expect = torch.zeros_like(U[:, 0])
        for j in (range(m + 1, N) if reverse else range(m)):
            between = range(m + 1, j) if reverse else range(j + 1, m)
            factor = torch.ones(G, dtype=torch.float64)
            for l in between:
                factor = factor * (whole[:, l] if decay else 1.0)
            expect += factor[:, None, None] * U[:, j]
        assert torch.allclose(x[:, m], expect), m


@pytest.mark.parametrize("bidirectional", [False, True])
def test_chunk_decay_matrix_equals_exact_decays(bidirectional):
    """The within-chunk decays built from sub-block factors against ``exp(c_i - c_j)`` taken directly,
    with a chunk that is not a whole number of sub-blocks and gates both mild and steep."""
    g = torch.Generator().manual_seed(5)
    C = chunk_module.SUB * 2 + 3
    logs = torch.cat([F.logsigmoid(torch.randn(2, C, generator=g, dtype=torch.float64) + 2),
                      torch.full((1, C), -3.0, dtype=torch.float64)])
    cf, cb = logs.cumsum(-1), logs.flip(0).cumsum(-1)
    W = chunk_module.decay_matrix(cf, cb, bidirectional, 3, C, torch.float64, torch.device("cpu"))
    i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
    exact = torch.where(i >= j, (cf[:, :, None] - cf[:, None, :]).clamp(max=0).exp(), 0.0)
    if bidirectional:
        exact = exact + torch.where(i < j, (cb[:, None, :] - cb[:, :, None]).clamp(max=0).exp(), 0.0)
    assert torch.allclose(W, exact, rtol=1e-12, atol=1e-300)


def test_operator_runs_without_fairseq():
    """A PyTorch model of one's own takes the operator without fairseq (SPEC 1: pure PyTorch): with fairseq
    absent, importing ``lion_fairseq.ops`` loads none of it and works; the package warns what to install
    for the models, and asking for a hub class raises that."""
    code = """if True:
        import sys, warnings
        sys.modules["fairseq"] = None  # as if not installed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from lion_fairseq.ops import lion_attention
        assert any("ve-fairseq==0.12.3" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert not any(m.split(".")[0] == "fairseq" and sys.modules[m] is not None for m in sys.modules)
        import torch
        q, k, v = (torch.rand(1, 2, 9, 4) for _ in range(3))
        torch.testing.assert_close(lion_attention(q, k, v, form="chunk", chunk_size=4), lion_attention(q, k, v))
        try:
            from lion_fairseq import LionRobertaModel
        except ImportError as e:
            assert "lion_fairseq.ops, does not" in str(e) and "ve-fairseq" in str(e)
        else:
            raise AssertionError("the hub class imported without fairseq")
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_importing_the_plugin_leaves_pythons_logging_as_it_was():
    """``import lion_fairseq`` (``lion_fairseq.ops`` too) imports fairseq where it is installed, two of whose
    modules call ``logging.basicConfig``, one at DEBUG: every library's debug lines then printed in the
    user's Python session. The root logger is left as it was; logging a user set up first stays theirs."""
    code = """if True:
        import logging, sys
        if sys.argv[1] == "configured":
            logging.basicConfig(level=logging.INFO, format="mine: %(message)s")
        before = (logging.getLogger().level, list(logging.getLogger().handlers))
        from lion_fairseq.ops import lion_attention
        assert "fairseq" in sys.modules
        assert (logging.getLogger().level, logging.getLogger().handlers) == before
        logging.getLogger("some.library").debug("a library's debug line")
        logging.getLogger("some.library").info("a library's info line")
    """
    for setup, printed in (("unconfigured", []), ("configured", ["mine: a library's info line"])):
        proc = subprocess.run([sys.executable, "-c", code, setup], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [line for line in proc.stderr.splitlines() if "a library's" in line] == printed, proc.stderr[-3000:]
