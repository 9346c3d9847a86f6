"""The chunkwise form: exact attention inside chunks of C tokens, ``Dk x Dv`` states carried between them,
one scan per direction. O(L*C*D + L*D^2) time, O(L*C + L*D^2/C) extra memory, no L x L tensor.

Both directions are written as one masked product ``o = ((q k^T) * W) v`` with
``W = W_fwd + W_bwd^T``: ``W_fwd`` the lower triangle (diagonal included) of the forward decays and
``W_bwd`` the strict lower triangle of the backward decays on shifted gates. The backward pass is written
out (not traced through the loop over chunks): it reuses the decays of the forward pass and costs about
three forward passes."""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class Decay(NamedTuple):
    """One direction's decays on the chunk grid, for ``M_ij = exp(cum_i - cum_j)`` (i >= j), with ``c``
    the within-chunk inclusive cumulative log-gate; every exponent is a partial sum of log-gates <= 0."""
    intra: Tensor             # (B, H, N, C, C) M_ij inside a chunk, 0 above (and on) the diagonal as asked
    from_start: Optional[Tensor]  # (B, H, N, C) exp(c_i): decay from the chunk's start to i
    to_end: Optional[Tensor]      # (B, H, N, C) exp(c_last - c_j): decay from j to the chunk's end
    whole: Optional[Tensor]       # (B, H, N) exp(c_last): decay across the chunk


def make_decay(log_a: Optional[Tensor], N: int, C: int, strict: bool, dtype: torch.dtype,
               device: torch.device) -> Decay:
    """log_a: ``(B, H, N*C)`` or None (gates 1)."""
    tri = torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)
    if log_a is None:
        return Decay(tri.to(dtype), None, None, None)
    B, H, _ = log_a.shape
    # float64 inside a chunk keeps c_i - c_j exact near the diagonal whatever the gates' scale
    c = log_a.view(B, H, N, C).double().cumsum(-1)
    intra = (c[..., :, None] - c[..., None, :]).masked_fill_(~tri, float("-inf")).to(dtype).exp_()
    return Decay(intra, c.to(dtype).exp(), (c[..., -1:] - c).to(dtype).exp(), c[..., -1].to(dtype).exp())


def _scale(x: Tensor, s: Optional[Tensor]) -> Tensor:
    return x * s[..., None] if s is not None else x


def _scan_chunks(U: Tensor, whole: Optional[Tensor], reverse: bool) -> Tensor:
    """Exclusive scan over chunks: ``out_n = sum_{m before n} (decays of the chunks between) U_m``.

    U: ``(B, H, N, Dk, Dv)``, updated in place into the inclusive scan; one fused op per chunk, since a
    Python-level op per chunk is what this form pays for its O(L) memory."""
    N = U.shape[2]
    order = range(N - 2, -1, -1) if reverse else range(1, N)
    step = 1 if reverse else -1
    for n in order:  # U_n += (decay across chunk n) * U_{n -/+ 1}
        if whole is None:
            U[:, :, n].add_(U[:, :, n + step])
        else:
            U[:, :, n].addcmul_(U[:, :, n + step], whole[:, :, n, None, None])
    out = torch.zeros_like(U)
    if reverse:
        out[:, :, :-1] = U[:, :, 1:]
    else:
        out[:, :, 1:] = U[:, :, :-1]
    return out


def inter_causal(x: Tensor, y: Tensor, z: Tensor, d: Decay) -> Tensor:
    """``o_i = sum_{j in earlier chunks} M_ij (x_i . y_j) z_j`` through the states entering each chunk.
    x, y: ``(B, H, N, C, Dk)``; z: ``(B, H, N, C, Dv)``."""
    U = _scale(y, d.to_end).transpose(-1, -2) @ z  # each chunk's own contribution, (B, H, N, Dk, Dv)
    return _scale(x, d.from_start) @ _scan_chunks(U, d.whole, reverse=False)


def inter_anticausal(x: Tensor, y: Tensor, z: Tensor, d: Decay) -> Tensor:
    """``o_t = sum_{s in later chunks} M_st (x_t . y_s) z_s``, the transpose of ``inter_causal``."""
    U = _scale(y, d.from_start).transpose(-1, -2) @ z
    return _scale(x, d.to_end) @ _scan_chunks(U, d.whole, reverse=True)


def _masked(x: Tensor, y: Tensor, z: Tensor, W: Tensor) -> Tensor:
    return ((x @ y.transpose(-1, -2)) * W) @ z


class _ChunkAttention(torch.autograd.Function):
    """``o = ((q k^T) * W) v`` on the chunk grid (inputs already padded to N*C and viewed as chunks)."""

    @staticmethod
    def forward(ctx, q, k, v, log_f, log_b, C, bidirectional):
        B, H, N, _, _ = q.shape
        fwd = make_decay(log_f, N, C, strict=False, dtype=q.dtype, device=q.device)
        bwd = make_decay(log_b, N, C, strict=True, dtype=q.dtype, device=q.device) if bidirectional else None
        W = fwd.intra + bwd.intra.transpose(-1, -2) if bwd is not None else fwd.intra
        o = _masked(q, k, v, W) + inter_causal(q, k, v, fwd)
        if bwd is not None:
            o = o + inter_anticausal(q, k, v, bwd)
        ctx.save_for_backward(q, k, v, W, *fwd, *(bwd or ()))
        ctx.has_f, ctx.has_b, ctx.bidirectional = log_f is not None, log_b is not None, bidirectional
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, W, *decays = ctx.saved_tensors
        fwd = Decay(*decays[:4])
        bwd = Decay(*decays[4:]) if ctx.bidirectional else None
        do = do.contiguous()
        WT = W.transpose(-1, -2)
        qk, dov = q @ k.transpose(-1, -2), do @ v.transpose(-1, -2)
        # dq = ((do v^T) * W) k, dk = ((v do^T) * W^T) q, dv = ((k q^T) * W^T) do; the inter-chunk parts
        # of each direction are kept apart for the gates' gradients.
        dq_f, dk_f = inter_causal(do, v, k, fwd), inter_anticausal(v, do, q, fwd)
        dq = (dov * W) @ k + dq_f
        dk = (dov.transpose(-1, -2) * WT) @ q + dk_f
        dv = (qk.transpose(-1, -2) * WT) @ do + inter_anticausal(k, q, do, fwd)
        if bwd is not None:
            dq_b, dk_b = inter_anticausal(do, v, k, bwd), inter_causal(v, do, q, bwd)
            dq, dk = dq + dq_b, dk + dk_b
            dv = dv + inter_causal(k, q, do, bwd)
        # d loss / d (cumulative log-gate at t) = what t gains as a query minus what it gives as a key,
        # P_ij = M_ij (q_i . k_j)(do_i . v_j); log_a_u enters every cumulative sum from u on.
        E = qk * dov
        dlog_f = dlog_b = None
        if ctx.has_f:
            Ef = E * fwd.intra
            dcum = Ef.sum(-1) - Ef.sum(-2) + (q * dq_f).sum(-1) - (k * dk_f).sum(-1)
            dlog_f = _suffix_sum(dcum)
        if ctx.has_b:
            Eb = E * bwd.intra.transpose(-1, -2)  # query t, key s > t; s plays the role of i
            dcum = Eb.sum(-2) - Eb.sum(-1) + (k * dk_b).sum(-1) - (q * dq_b).sum(-1)
            dlog_b = _suffix_sum(dcum)
        return dq, dk, dv, dlog_f, dlog_b, None, None


def _suffix_sum(dcum: Tensor) -> Tensor:
    """``(B, H, N, C)`` per-position gradients of cumulative sums -> ``(B, H, N*C)`` gradients of the
    log-gates; position 0's gate lies on no path."""
    B, H, N, C = dcum.shape
    flat = dcum.reshape(B, H, N * C).double()
    out = flat.flip(-1).cumsum(-1).flip(-1)
    out[..., 0] = 0.0
    return out.to(dcum.dtype)


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor],
                    log_a_bwd: Optional[Tensor], causal: bool, chunk_size: int) -> Tensor:
    """q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)`` (the normaliser as its last column if wanted);
    gates ``(B, H, L)`` or None. Returns ``(B, H, L, Dv)``."""
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
    o = _ChunkAttention.apply(q.reshape(B, H, N, C, Dk), k.reshape(B, H, N, C, Dk), v.reshape(B, H, N, C, Dv),
                              log_a_fwd, log_b, C, not causal)
    return o.reshape(B, H, N * C, Dv)[:, :, :L]
