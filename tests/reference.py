"""A naive float64 LION attention that follows SPEC section 1 literally: the fast forms are checked
against it, as flash-linear-attention checks each kernel against its naive twin."""
from typing import Optional

import torch
from torch import Tensor


def reference_mask(f: Tensor, b: Tensor, causal: bool) -> Tensor:
    """``M`` ``(..., L, L)`` from gates ``f``, ``b`` ``(..., L)`` as products, one entry at a time."""
    L = f.shape[-1]
    M = torch.zeros(*f.shape[:-1], L, L, dtype=torch.float64)
    for i in range(L):
        for j in range(L):
            if i == j:
                M[..., i, j] = 1.0
            elif i > j:
                M[..., i, j] = torch.prod(f[..., j + 1:i + 1], dim=-1)
            elif not causal:
                M[..., i, j] = torch.prod(b[..., i:j], dim=-1)
    return M


def reference_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor] = None,
                        log_a_bwd: Optional[Tensor] = None, *, causal: bool = False, normalize: bool = True,
                        key_padding_mask: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    q, k, v = q.double(), k.double(), v.double()
    B, H, L, _ = q.shape
    ones = torch.ones(B, H, L, dtype=torch.float64)
    f = log_a_fwd.double().exp().expand(B, H, L) if log_a_fwd is not None else ones
    b = log_a_bwd.double().exp().expand(B, H, L) if log_a_bwd is not None else ones
    A = (q @ k.transpose(-1, -2)) * reference_mask(f, b, causal)
    if key_padding_mask is not None:
        A = A.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    y = A @ v
    if normalize:
        y = y / (A.sum(-1, keepdim=True) + eps)
    return y


def fast_reference_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor] = None,
                             log_a_bwd: Optional[Tensor] = None, *, causal: bool = False, normalize: bool = True,
                             key_padding_mask: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """The same definition with the mask's products taken as differences of float64 cumulative sums, for L
    in the thousands where the loops above are too slow; checked against ``reference_attention``."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, L, _ = q.shape
    zero = torch.zeros(B, H, L, dtype=torch.float64)
    a = log_a_fwd.double().expand(B, H, L) if log_a_fwd is not None else zero
    b = log_a_bwd.double().expand(B, H, L) if log_a_bwd is not None else zero
    fwd = a.cumsum(-1)             # log f_1 ... f_i, up to a constant
    bwd = b.cumsum(-1) - b         # log b_0 ... b_{i-1}
    i = torch.arange(L)
    lower = i[:, None] >= i[None, :]
    logM = torch.where(lower, fwd[..., :, None] - fwd[..., None, :], bwd[..., None, :] - bwd[..., :, None])
    if causal:
        logM = logM.masked_fill(~lower, float("-inf"))
    A = (q @ k.transpose(-1, -2)) * logM.exp()
    if key_padding_mask is not None:
        A = A.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    y = A @ v
    if normalize:
        y = y / (A.sum(-1, keepdim=True) + eps)
    return y
