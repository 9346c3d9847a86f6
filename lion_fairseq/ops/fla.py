"""LION on flash-linear-attention's Triton kernels (CUDA): each direction is one call of fla's
``chunk_simple_gla``, the causal linear attention with one scalar log-decay per token and head,
``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * q_t S_t``
(fla-core 0.6.0: ``fla/ops/simple_gla/chunk.py`` lines 238-355, its naive twin
``fla/ops/simple_gla/naive.py`` lines 61-94).

fla is optional (``pip install fla-core``, the ``fla`` extra); ``fla_available`` says whether it can run
on a tensor, and ``LION_FLA=0`` turns it off (the PyTorch chunk form runs instead)."""
import functools
import importlib.util
import os
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# fla's 16-bit backward rejects odd head dims (chunk_bwd_dv, fla/ops/common/chunk_o.py:604-606), and the
# normaliser's column of ones makes Dv odd (65 for D = 64); zero columns up to a multiple of 8 also keep
# every row 16-byte aligned.
ALIGN = 8


@functools.lru_cache(maxsize=None)
def _load() -> Optional[Callable]:
    """fla's ``chunk_simple_gla``, or None when it is not installed or does not import (tried once)."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # installed but broken (say a Triton that does not fit): falling back silently would hide it
        warnings.warn(f"flash-linear-attention is installed but does not import ({e!r}); "
                      "LION's chunk form runs in PyTorch instead")
        return None
    return chunk_simple_gla


def fla_available(x: Tensor) -> bool:
    """True when ``x`` can go through fla: on CUDA, in a dtype fla's kernels take, fla imports, and the
    environment variable ``LION_FLA`` is not ``"0"``."""
    return (os.environ.get("LION_FLA", "1") != "0" and x.is_cuda and x.dtype in FLA_DTYPES
            and _load() is not None)


def _gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor]) -> Tensor:
    """fla's ``o_i = sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j`` on fla's layout: q, k
    ``(B, L, H, Dk)``, v ``(B, L, H, Dv)`` contiguous, one dtype; g ``(B, L, H)`` float32 or None (no decay).
    Returns ``(B, L, H, Dv)`` in v's dtype."""
    kernel = _load()
    if kernel is None:
        raise RuntimeError("flash-linear-attention's chunk_simple_gla does not import: pip install fla-core")
    return kernel(q, k, v, g=g, scale=1.0)[0]


def _to_fla_layout(x: Tensor) -> Tensor:
    """``(B, H, L, D)`` -> contiguous ``(B, L, H, D')``, D' the next multiple of ALIGN: one copy."""
    x = x.transpose(1, 2)
    pad = -x.shape[-1] % ALIGN
    return (F.pad(x, (0, pad)) if pad else x).contiguous()


def fla_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor], log_a_bwd: Optional[Tensor],
                  causal: bool) -> Tensor:
    """``o = ((q k^T) * M) v`` with LION's mask ``M`` (SPEC section 1), both directions on fla's kernels.

    q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)`` (the normaliser as its last column if wanted), all in one
    dtype of ``FLA_DTYPES`` (16-bit stays 16-bit: fla accumulates in float32); log-gates ``(B, H, L)``
    ``<= 0`` or None (gate 1). Returns ``(B, H, L, Dv)`` in float32 (float64 for float64 inputs), the two
    directions summed in that precision. Differentiable in every tensor input."""
    Dv = v.shape[-1]
    acc = torch.promote_types(v.dtype, torch.float32)
    q, k, v = (_to_fla_layout(x) for x in (q, k, v))  # everything below is (B, L, H, ...)
    f = log_a_fwd.to(acc).transpose(1, 2).contiguous() if log_a_fwd is not None else None  # float32 gates
    # forward direction, diagonal included: fla's recurrence with g = log f is M_ij = f_{j+1} ... f_i (i >= j)
    out = _gla(q, k, v, f).to(acc)
    if not causal:
        # Backward direction: o_i = sum_{j > i} (b_i ... b_{j-1}) (q_i . k_j) v_j, diagonal excluded. Index the
        # keys by p = j - 1 >= i and fold the gate b_p into them: with k~_p = b_p k_{p+1}, v~_p = v_{p+1}
        # (zero at p = L - 1),
        #     o_i = sum_{p >= i} (b_i ... b_{p-1}) (q_i . k~_p) v~_p,
        # the inclusive reversed scan S_i = b_i S_{i+1} + k~_i v~_i^T, o_i = q_i S_i: fla's recurrence on
        # everything flipped along L with g = flip(log b). The diagonal term never enters (no subtraction of
        # q_i . k_i v_i, which would cancel in bf16), and b_p <= 1 so k~ is no larger than k. b_{L-1} meets
        # only zeros, as in M.
        b = log_a_bwd.to(acc).transpose(1, 2).contiguous() if log_a_bwd is not None else None
        k_next = F.pad(k[:, 1:], (0, 0, 0, 0, 0, 1))
        v_next = F.pad(v[:, 1:], (0, 0, 0, 0, 0, 1))
        if b is not None:  # the product in float32, rounded once to k's dtype
            k_next = (k_next.to(acc) * b.exp()[..., None]).to(k.dtype)
        back = _gla(q.flip(1), k_next.flip(1), v_next.flip(1), b.flip(1) if b is not None else None)
        out = out + back.flip(1).to(acc)
    return out.transpose(1, 2)[..., :Dv]
