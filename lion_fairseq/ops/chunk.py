"""The chunkwise form: exact attention inside chunks of C tokens, ``Dk x Dv`` states carried between them,
one scan per direction. O(L*C*D + L*D^2) time, O(L*D) memory: no L x L tensor, and nothing of size
L x C either, since the chunks are processed a block of tokens at a time.

Both directions are written as one masked product ``o = ((q k^T) * W) v`` inside a chunk, with
``W = W_fwd + W_bwd^T``: ``W_fwd`` the lower triangle (diagonal included) of the forward decays and
``W_bwd`` the strict lower triangle of the backward decays on shifted gates. Between chunks, each
direction carries its state across the blocks: left to right for the forward direction, right to left
for the backward one. The backward pass is written out (not traced through the loops): it recomputes
each block's decays rather than storing them, so training stores only the inputs."""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# Tokens per block: the block's C x C decays and scores (H * BLOCK * C floats) stay in the CPU's cache,
# where a whole-sequence tensor of them would be paged in from memory afresh on every call.
BLOCK_TOKENS = 1024


class Decay(NamedTuple):
    """One direction's decays on the chunk grid for ``M_ij = exp(c_i - c_j)`` (i >= j), with ``c`` the
    within-chunk inclusive cumulative log-gate (float64, so ``c_i - c_j`` is exact near the diagonal);
    every exponent is a partial sum of log-gates, so <= 0."""
    cum: Tensor         # (N, B, H, C) float64 c
    from_start: Tensor  # (N, B, H, C) exp(c_i): decay from the chunk's start to i
    to_end: Tensor      # (N, B, H, C) exp(c_last - c_j): decay from j to the chunk's end
    whole: Tensor       # (N, B, H) exp(c_last): decay across the chunk


def make_decay(log_a: Optional[Tensor], N: int, C: int, dtype: torch.dtype) -> Optional[Decay]:
    """log_a: ``(B, H, N*C)`` or None (gates 1, no decay)."""
    if log_a is None:
        return None
    B, H, _ = log_a.shape
    c = log_a.view(B, H, N, C).permute(2, 0, 1, 3).double().cumsum(-1)
    return Decay(c, c.to(dtype).exp(), (c[..., -1:] - c).to(dtype).exp(), c[..., -1].to(dtype).exp())


# Tokens per sub-block of a chunk's decay matrix: the diagonal sub-blocks take exact differences
# (C * SUB exps), the rest of the lower triangle a rank-1 product per row sub-block.
SUB = 16


def intra_decay(d: Optional[Decay], n0: int, n1: int, tri: Tensor, dtype: torch.dtype) -> Tensor:
    """``(n1-n0, B, H, C, C)`` decays ``exp(c_i - c_j)`` inside chunks n0..n1-1, zero outside the
    triangle ``tri`` (the lower one, with or without its diagonal).

    Every exponent is <= 0, whatever the gates, and nothing is decided on the host (no device sync).
    Rows are grouped in sub-blocks of ``SUB`` tokens; for row i in sub-block p and a column j before it,
    ``exp(c_i - c_j) = exp(c_i - a_p) * exp(a_p - c_j)`` with the anchor ``a_p`` the cumulative log-gate
    just before sub-block p, and both factors are decays (c does not increase). Each is exp'd in float64
    and rounded once, so the product is within a few ulps of the exact decay; inside the diagonal
    sub-blocks the exact differences are exp'd."""
    if d is None:
        return tri.to(dtype)
    c = d.cum[n0:n1]  # (n, B, H, C) float64, non-increasing along C
    C = c.shape[-1]
    S = min(SUB, C)
    P = -(-C // S)
    if P * S > C:  # pad with the last value (gate 1): the extra rows and columns are cropped below
        c = torch.cat([c, c[..., -1:].expand(*c.shape[:-1], P * S - C)], dim=-1)
    blocks = c.view(*c.shape[:-1], P, S)
    anchor = F.pad(blocks[..., :-1, -1], (1, 0))  # (..., P): c before each sub-block (0 before the chunk)
    rows = (blocks - anchor[..., None]).exp().to(dtype)  # (..., P, S)
    before = torch.arange(P * S, device=c.device)[None, :] < (torch.arange(P, device=c.device) * S)[:, None]
    cols = (anchor[..., :, None] - c[..., None, :]).masked_fill(~before, float("-inf")).exp().to(dtype)
    W = rows[..., :, :, None] * cols[..., :, None, :]  # (..., P, S, P*S): the sub-blocks left of the diagonal
    diag = (blocks[..., :, None] - blocks[..., None, :]).masked_fill(~tri[:S, :S], float("-inf")).exp()
    W = W.view(*W.shape[:-3], P, S, P, S)
    W.diagonal(dim1=-4, dim2=-2).copy_(diag.movedim(-3, -1))
    W = W.view(*W.shape[:-4], P * S, P * S)
    return W[..., :C, :C].contiguous() if P * S > C else W


def _scale(x: Tensor, s: Optional[Tensor]) -> Tensor:
    return x * s[..., None] if s is not None else x


def inter_block(x: Tensor, y: Tensor, z: Tensor, d: Optional[Decay], n0: int, n1: int, carry: Tensor,
                reverse: bool) -> Tuple[Tensor, Tensor]:
    """The between-chunk part for chunks n0..n1-1: ``o_i = sum_{j in earlier chunks} M_ij (x_i . y_j) z_j``
    (later chunks when ``reverse``), through the states entering each chunk.

    x, y: ``(n, B, H, C, Dk)``; z: ``(n, B, H, C, Dv)``; carry: ``(B, H, Dk, Dv)`` the state entering
    the block from before it (after it when ``reverse``). Returns the block's ``(n, B, H, C, Dv)`` and the
    state leaving it."""
    s = slice(n0, n1)
    if d is None:
        own, read, whole = y, x, None
    elif reverse:
        own, read, whole = _scale(y, d.from_start[s]), _scale(x, d.to_end[s]), d.whole[s]
    else:
        own, read, whole = _scale(y, d.to_end[s]), _scale(x, d.from_start[s]), d.whole[s]
    n = n1 - n0
    # E_m: the state entering chunk m; E has one more slot for the state leaving the block
    E = carry.new_empty((n + 1,) + carry.shape)
    # each chunk's own contribution U_m, written straight into the slot after it
    if reverse:
        E[n] = carry
        torch.matmul(own.transpose(-1, -2), z, out=E[:n])
        steps = [(m, m, m + 1) for m in range(n - 1, -1, -1)]
    else:
        E[0] = carry
        torch.matmul(own.transpose(-1, -2), z, out=E[1:])
        steps = [(m, m + 1, m) for m in range(n)]
    # one fused in-place op per chunk m: (state past m) = U_m + (decay across m) * (state before m)
    for m, past, before in steps:
        if whole is None:
            E[past].add_(E[before])
        else:
            E[past].addcmul_(E[before], whole[m, :, :, None, None])
    if reverse:
        entering, leaving = E[1:], E[0]
    else:
        entering, leaving = E[:n], E[n]
    return read @ entering, leaving.clone()


def _blocks(N: int, C: int):
    per = max(1, BLOCK_TOKENS // C)
    return [(n0, min(n0 + per, N)) for n0 in range(0, N, per)]


def _take(x: Tensor, s: slice, ones: bool = False) -> Tensor:
    """Chunks ``s`` of ``(B, H, N, C, D)`` as one contiguous ``(n, B, H, C, D)`` batch for the matmuls,
    with a column of ones added if ``ones``."""
    x = x[:, :, s].permute(2, 0, 1, 3, 4)
    return _with_ones(x) if ones else x.contiguous()


def _put(dst: Tensor, s: slice, val: Tensor, add: bool = False) -> None:
    view = dst[:, :, s]
    val = val.permute(1, 2, 0, 3, 4)
    view.add_(val) if add else view.copy_(val)


class _Grid(NamedTuple):
    """What the forward and backward passes share: each direction's decays, the masks, the blocks."""
    fwd: Optional[Decay]
    bwd: Optional[Decay]
    lower: Tensor   # (C, C) bool, diagonal included: the forward direction
    strict: Tensor  # (C, C) bool, diagonal excluded: the backward direction on shifted gates
    blocks: list


def _grid(log_f: Optional[Tensor], log_b: Optional[Tensor], N: int, C: int, dtype: torch.dtype,
          device: torch.device) -> _Grid:
    lower = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    return _Grid(make_decay(log_f, N, C, dtype), make_decay(log_b, N, C, dtype), lower, lower.tril(-1),
                 _blocks(N, C))


def _masks(g: _Grid, n0: int, n1: int, bidirectional: bool, dtype: torch.dtype) -> Tuple[Tensor, Optional[Tensor]]:
    """``W_fwd`` and ``W_bwd^T`` (None when causal) of chunks n0..n1-1; ``W`` is their sum."""
    Wf = intra_decay(g.fwd, n0, n1, g.lower, dtype)
    return Wf, intra_decay(g.bwd, n0, n1, g.strict, dtype).transpose(-1, -2) if bidirectional else None


def _with_ones(v: Tensor) -> Tensor:
    """v ``(..., Dv)`` with a column of ones: the normaliser ``sum_j A_ij`` rides along as one more output."""
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)


class _ChunkAttention(torch.autograd.Function):
    """``o = ((q k^T) * W) v`` on the chunk grid, divided by ``((q k^T) * W) 1 + eps`` when normalising:
    q, k ``(B, H, N, C, Dk)``, v ``(B, H, N, C, Dv)`` (padded to N*C tokens); log-gates ``(B, H, N*C)``
    or None. The normaliser is a column of ones added to each block of v, and the division is done per
    block, so that no sequence-long temporary is made for either."""

    @staticmethod
    def forward(ctx, q, k, v, log_f, log_b, C, bidirectional, normalize, eps):
        B, H, N, _, Dk = q.shape
        Dv = v.shape[-1] + normalize
        dtype = q.dtype
        g = _grid(log_f, log_b, N, C, dtype, q.device)
        y = v.new_empty(v.shape)
        den = q.new_empty(N, B, H, C) if normalize else None

        def finish(o: Tensor, s: slice) -> None:
            if normalize:
                den[s] = o[..., -1]
                o = o[..., :-1] / (o[..., -1:] + eps)
            _put(y, s, o)

        # the forward direction's part of each block waits here (chunks first) for the backward one's
        partial = q.new_empty(N, B, H, C, Dv) if bidirectional else None
        carry = q.new_zeros(B, H, Dk, Dv)
        for n0, n1 in g.blocks:  # within chunks, and the forward direction's states
            s = slice(n0, n1)
            Wf, Wb = _masks(g, n0, n1, bidirectional, dtype)
            W = Wf + Wb if Wb is not None else Wf
            qs, ks, vs = _take(q, s), _take(k, s), _take(v, s, normalize)
            o, carry = inter_block(qs, ks, vs, g.fwd, n0, n1, carry, reverse=False)
            o.add_(((qs @ ks.transpose(-1, -2)) * W) @ vs)
            if bidirectional:
                partial[s] = o
            else:
                finish(o, s)
        if bidirectional:
            carry = q.new_zeros(B, H, Dk, Dv)
            for n0, n1 in reversed(g.blocks):
                s = slice(n0, n1)
                o, carry = inter_block(_take(q, s), _take(k, s), _take(v, s, normalize), g.bwd, n0, n1, carry,
                                       reverse=True)
                finish(o.add_(partial[s]), s)
        ctx.save_for_backward(q, k, v, log_f, log_b, y, den)
        ctx.C, ctx.bidirectional, ctx.normalize, ctx.eps = C, bidirectional, normalize, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, log_f, log_b, y, den = ctx.saved_tensors
        C, bidirectional, normalize, eps = ctx.C, ctx.bidirectional, ctx.normalize, ctx.eps
        B, H, N, _, Dk = q.shape
        Dv = v.shape[-1] + normalize
        dtype = q.dtype
        g = _grid(log_f, log_b, N, C, dtype, q.device)
        fwd, bwd = g.fwd, g.bwd
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def grad_out(s: slice) -> Tensor:
            """The gradient w.r.t. the block's unnormalised output (and its normaliser column)."""
            dys = _take(dy, s)
            if not normalize:
                return dys
            inv = 1.0 / (den[s, ..., None] + eps)
            return torch.cat([dys * inv, -(dys * _take(y, s)).sum(-1, keepdim=True) * inv], dim=-1)

        def put_dv(s: slice, val: Tensor, add: bool = False) -> None:
            _put(dv, s, val[..., :-1] if normalize else val, add)  # the ones column has no gradient

        # d loss / d (cumulative log-gate at t) = what t gains as a query minus what it gives as a key,
        # P_ij = M_ij (q_i . k_j)(do_i . v_j); log_a_u enters every cumulative sum from u on.
        dcum_f = q.new_zeros(N, B, H, C) if fwd is not None else None
        dcum_b = q.new_zeros(N, B, H, C) if bwd is not None else None
        # dq = ((do v^T) * W) k, dk = ((v do^T) * W^T) q, dv = ((k q^T) * W^T) do: the inside of chunks,
        # then the between-chunk parts whose states run left to right (forward direction's dq, backward
        # direction's dk and dv), then those running right to left.
        c_dq, c_dk, c_dv = q.new_zeros(B, H, Dv, Dk), q.new_zeros(B, H, Dv, Dk), q.new_zeros(B, H, Dk, Dv)
        for n0, n1 in g.blocks:
            s = slice(n0, n1)
            qs, ks, vs, dos = _take(q, s), _take(k, s), _take(v, s, normalize), grad_out(s)
            Wf, Wb = _masks(g, n0, n1, bidirectional, dtype)
            W = Wf + Wb if Wb is not None else Wf
            qk, dov = qs @ ks.transpose(-1, -2), dos @ vs.transpose(-1, -2)
            dovW = dov * W
            dq_f, c_dq = inter_block(dos, vs, ks, fwd, n0, n1, c_dq, reverse=False)
            dk_s = dovW.transpose(-1, -2) @ qs
            dv_s = (qk * W).transpose(-1, -2) @ dos
            if fwd is not None or bwd is not None:
                E = qk * dov
            if fwd is not None:
                Ef = E * Wf
                dcum_f[s] = Ef.sum(-1) - Ef.sum(-2) + (qs * dq_f).sum(-1)
            _put(dq, s, dq_f.add_(dovW @ ks))
            if bidirectional:
                dk_b, c_dk = inter_block(vs, dos, qs, bwd, n0, n1, c_dk, reverse=False)
                dv_b, c_dv = inter_block(ks, qs, dos, bwd, n0, n1, c_dv, reverse=False)
                if bwd is not None:
                    Eb = E * Wb  # query t, key s > t; s plays the role of i
                    dcum_b[s] = Eb.sum(-2) - Eb.sum(-1) + (ks * dk_b).sum(-1)
                dk_s += dk_b
                dv_s += dv_b
            _put(dk, s, dk_s)
            put_dv(s, dv_s)
        c_dk, c_dv, c_dq = q.new_zeros(B, H, Dv, Dk), q.new_zeros(B, H, Dk, Dv), q.new_zeros(B, H, Dv, Dk)
        for n0, n1 in reversed(g.blocks):
            s = slice(n0, n1)
            qs, ks, vs, dos = _take(q, s), _take(k, s), _take(v, s, normalize), grad_out(s)
            dk_f, c_dk = inter_block(vs, dos, qs, fwd, n0, n1, c_dk, reverse=True)
            dv_f, c_dv = inter_block(ks, qs, dos, fwd, n0, n1, c_dv, reverse=True)
            if fwd is not None:
                dcum_f[s] -= (ks * dk_f).sum(-1)
            _put(dk, s, dk_f, add=True)
            put_dv(s, dv_f, add=True)
            if bidirectional:
                dq_b, c_dq = inter_block(dos, vs, ks, bwd, n0, n1, c_dq, reverse=True)
                if bwd is not None:
                    dcum_b[s] -= (qs * dq_b).sum(-1)
                _put(dq, s, dq_b, add=True)
        dlog_f = _suffix_sum(dcum_f) if dcum_f is not None and ctx.needs_input_grad[3] else None
        dlog_b = _suffix_sum(dcum_b) if dcum_b is not None and ctx.needs_input_grad[4] else None
        return dq, dk, dv, dlog_f, dlog_b, None, None, None, None


def _suffix_sum(dcum: Tensor) -> Tensor:
    """``(N, B, H, C)`` per-position gradients of cumulative sums -> ``(B, H, N*C)`` gradients of the
    log-gates; position 0's gate lies on no path."""
    N, B, H, C = dcum.shape
    flat = dcum.permute(1, 2, 0, 3).reshape(B, H, N * C).double()
    out = flat.flip(-1).cumsum(-1).flip(-1)
    out[..., 0] = 0.0
    return out.to(dcum.dtype)


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor],
                    log_a_bwd: Optional[Tensor], causal: bool, chunk_size: int, normalize: bool = False,
                    eps: float = 1e-6) -> Tensor:
    """q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)``; gates ``(B, H, L)`` or None. Returns ``(B, H, L, Dv)``:
    ``((q k^T) * M) v``, divided row by row by ``sum_j (q k^T * M)_ij + eps`` if ``normalize``."""
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, L)
    N = -(-L // C)
    pad = N * C - L
    # The backward direction as a forward-style decay on gates shifted by one:
    # b_i ... b_{j-1} = a'_{i+1} ... a'_j with a'_u = b_{u-1}.
    log_b = F.pad(log_a_bwd[..., :-1], (1, 0)) if (log_a_bwd is not None and not causal) else None
    if pad:  # zero tokens and gates of 1 at the end: they contribute nothing in either direction
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        log_a_fwd = F.pad(log_a_fwd, (0, pad)) if log_a_fwd is not None else None
        log_b = F.pad(log_b, (0, pad)) if log_b is not None else None
    y = _ChunkAttention.apply(q.reshape(B, H, N, C, Dk), k.reshape(B, H, N, C, Dk), v.reshape(B, H, N, C, Dv),
                              log_a_fwd, log_b, C, not causal, normalize, eps)
    y = y.reshape(B, H, N * C, Dv)
    return y[:, :, :L] if pad else y
