"""The parallel form: one L x L masked score matrix per head (the Transformer-like training form)."""
from typing import Optional

import torch
from torch import Tensor


def log_mask(log_a_fwd: Optional[Tensor], log_a_bwd: Optional[Tensor], L: int, causal: bool,
             device: torch.device) -> Optional[Tensor]:
    """Log of the decay mask, ``(b, h, L, L)`` in float64 (``None`` when every gate is 1 and not causal).

    ``log_a_*`` are ``(b, h, L)`` float64. Cumulative sums run in float64 so that differences of two
    large sums near the diagonal keep their precision at any L.
    """
    i = torch.arange(L, device=device)
    lower = i[:, None] >= i[None, :]
    if log_a_fwd is None and log_a_bwd is None and not causal:
        return None
    zero = torch.zeros(1, 1, L, dtype=torch.float64, device=device)
    fwd = (log_a_fwd if log_a_fwd is not None else zero).cumsum(-1)
    # M_ij = f_{j+1} ... f_i  (i >= j)  = exp(F_i - F_j); the diagonal, 0, is filled in rather than
    # computed: as F_i - F_i its gradient would reach the gates and cancel only to rounding
    out = (fwd[..., :, None] - fwd[..., None, :]).masked_fill(~(i[:, None] > i[None, :]), 0.0)
    if causal:
        return out.masked_fill(~lower, float("-inf"))
    # M_ij = b_i ... b_{j-1}  (i < j)  = exp(R_j - R_i), R the exclusive cumulative sum
    bwd = log_a_bwd if log_a_bwd is not None else zero
    excl = bwd.cumsum(-1) - bwd
    upper = (excl[..., None, :] - excl[..., :, None]).masked_fill(lower, 0.0)
    return out + upper


def parallel_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor],
                       log_a_bwd: Optional[Tensor], causal: bool) -> "tuple[Tensor, Tensor]":
    """Unnormalised numerator ``(B, H, L, Dv)`` and denominator ``(B, H, L)``.

    q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)``, all in the compute dtype; gates ``(b, h, L)``
    float64 or None. Padded keys must already be zeroed.
    """
    L = q.shape[-2]
    scores = q @ k.transpose(-1, -2)
    logm = log_mask(log_a_fwd, log_a_bwd, L, causal, q.device)
    if logm is not None:
        scores = scores * logm.to(q.dtype).exp()
    return scores @ v, scores.sum(-1)
