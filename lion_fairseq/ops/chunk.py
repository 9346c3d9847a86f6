"""The chunkwise form: exact attention inside chunks of C tokens, a ``Dk x Dv`` state carried between
them. O(L*C*D + L*D^2) time, no L x L tensor. The backward pass is written out (not traced through
the loop over chunks) so that it costs a few forward passes and stores only the inputs."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def chunk_scan(q: Tensor, k: Tensor, v: Tensor, log_a: Optional[Tensor], chunk_size: int, strict: bool) -> Tensor:
    """Causal gated linear attention ``o_i = sum_{j <= i} exp(sum_{u=j+1..i} log_a_u) (q_i . k_j) v_j``
    (``j < i`` when ``strict``), without autograd.

    q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)``; log_a: ``(B, H, L)`` or None. Returns ``(B, H, L, Dv)``.
    Every ``exp`` argument is a partial sum of log-gates inside one chunk, hence ``<= 0``.
    """
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, L)
    N = -(-L // C)
    pad = N * C - L
    if pad:  # zeros at the end of a causal scan change nothing before them
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        log_a = F.pad(log_a, (0, pad)) if log_a is not None else None
    q, k, v = q.view(B, H, N, C, Dk), k.view(B, H, N, C, Dk), v.view(B, H, N, C, Dv)
    tri = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1 if strict else 0)
    scores = q @ k.transpose(-1, -2)
    if log_a is None:
        scores = scores.masked_fill_(~tri, 0.0)
        U = k.transpose(-1, -2) @ v
        qd, decay = q, None
    else:
        # float64 inside a chunk keeps c_i - c_j exact near the diagonal whatever the gates' scale
        c = log_a.view(B, H, N, C).double().cumsum(-1)
        intra = (c[..., :, None] - c[..., None, :]).masked_fill_(~tri, float("-inf"))
        scores = scores.mul_(intra.to(q.dtype).exp_())
        U = (k * (c[..., -1:] - c).to(q.dtype).exp()[..., None]).transpose(-1, -2) @ v
        qd = q * c.to(q.dtype).exp()[..., None]
        decay = c[..., -1].to(q.dtype).exp()
    o = scores @ v
    # states[:, :, n] is the state entering chunk n; only an elementwise update runs per chunk
    states = torch.empty_like(U)
    S = U.new_zeros(B, H, Dk, Dv)
    for n in range(N):
        states[:, :, n] = S
        S = (S * decay[:, :, n, None, None] if decay is not None else S) + U[:, :, n]
    o = o + qd @ states
    return o.reshape(B, H, N * C, Dv)[:, :, :L]


def _flip(x: Optional[Tensor], dim: int) -> Optional[Tensor]:
    return x.flip(dim) if x is not None else None


class _ChunkScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_a, chunk_size, strict):
        ctx.save_for_backward(q, k, v, log_a)
        ctx.chunk_size, ctx.strict = chunk_size, strict
        return chunk_scan(q, k, v, log_a, chunk_size, strict)

    @staticmethod
    def backward(ctx, do):
        q, k, v, log_a = ctx.saved_tensors
        C, strict = ctx.chunk_size, ctx.strict
        need_q, need_k, need_v, need_a = ctx.needs_input_grad[:4]
        do = do.contiguous()
        dq = dk = dv = da = None
        # dq_i = sum_{j<=i} M_ij (do_i . v_j) k_j: the same causal scan with (do, v, k)
        if need_q or need_a:
            dq = chunk_scan(do, v, k, log_a, C, strict)
        # dk, dv sum over queries i >= j: the causal scan on reversed time, where the gate between
        # positions j and j+1 moves to the later (reversed) position.
        if need_k or need_v or need_a:
            g = None
            if log_a is not None:
                g = F.pad(log_a.flip(-1)[..., :-1], (1, 0))
            qr, kr, vr, dor = q.flip(2), k.flip(2), v.flip(2), do.flip(2)
            if need_k or need_a:
                dk = chunk_scan(vr, dor, qr, g, C, strict).flip(2)
            if need_v:
                dv = chunk_scan(kr, qr, dor, g, C, strict).flip(2)
        if need_a:
            # d loss / d (cumulative log-gate at t) = q_t . dq_t - k_t . dk_t; log_a_u enters every
            # cumulative sum from u on. log_a_0 lies on no path.
            dcum = ((q * dq).sum(-1) - (k * dk).sum(-1)).double()
            da = dcum.flip(-1).cumsum(-1).flip(-1)
            da[..., 0] = 0.0
            da = da.to(log_a.dtype)
        return (dq if need_q else None), (dk if need_k else None), dv, da, None, None


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor],
                    log_a_bwd: Optional[Tensor], causal: bool, chunk_size: int) -> Tensor:
    """Forward scan (diagonal included) plus, unless ``causal``, the backward direction as a strict
    causal scan on reversed time. ``v`` carries the normaliser as its last column. Returns ``(B, H, L, Dv)``."""
    out = _ChunkScan.apply(q, k, v, log_a_fwd, chunk_size, False)
    if not causal:
        out = out + _ChunkScan.apply(q.flip(2), k.flip(2), v.flip(2), _flip(log_a_bwd, -1),
                                     chunk_size, True).flip(2)
    return out
