"""LION-D/S's feature map ``phi(x) = s / ||s||``, ``s = silu(x) + 0.5`` (the norm over the head dim), as one
Triton pass each way.

PyTorch computes it in four passes over the ``(B, H, L, D)`` tensor forward (silu, the shift, the norm, the
division) and about seven backward, each reading and writing memory, and autograd keeps ``s`` and the norm
for the backward. Here the forward reads x and writes phi(x); the backward reads x and the gradient and
writes x's, recomputing ``s`` and the norm in registers. Arithmetic in float32, outputs in x's dtype.
``modules.feature_maps.silu_norm`` is the reference and the path everywhere this kernel is not chosen.

With ``y = s / n``: ``ds = (dy - y (y . dy)) / n`` and ``dx = ds * silu'(x)``, where
``silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))``."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

import triton
import triton.language as tl

from .compiling import eager_under_compile
from .first_derivatives import first_derivatives_only
from .kernel import launching_on

ELEMENTS = 2048  # rows per program: as many as make about this many elements (4096 spilled on sm_90)


@triton.jit
def _shifted_silu(X, r, N, D, BD: tl.constexpr):
    """The rows r of X ``(N, D)`` in float32, ``s = silu(x) + 0.5`` (0 outside), its norm n over each row
    (1 outside), ``sigmoid(x)`` and their offsets and mask."""
    d = tl.arange(0, BD)
    mask = (r[:, None] < N) & (d[None, :] < D)
    off = r[:, None].to(tl.int64) * D + d[None, :]
    x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(x)
    s = tl.where(mask, x * sig + 0.5, 0.0)
    n = tl.where(r < N, tl.sqrt(tl.sum(s * s, 1)), 1.0)  # s >= 0.22 in each real row: n > 0
    return x, s, n, sig, off, mask


@triton.jit
def _silu_norm_forward(X, Y, N, D, BD: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    x, s, n, sig, off, mask = _shifted_silu(X, r, N, D, BD)
    tl.store(Y + off, (s / n[:, None]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_norm_backward(X, DY, DX, N, D, BD: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    x, s, n, sig, off, mask = _shifted_silu(X, r, N, D, BD)
    y = s / n[:, None]
    dy = tl.load(DY + off, mask=mask, other=0.0).to(tl.float32)
    ds = (dy - y * tl.sum(y * dy, 1)[:, None]) / n[:, None]
    tl.store(DX + off, (ds * sig * (1.0 + x * (1.0 - sig))).to(DX.dtype.element_ty), mask=mask)


def _rows(x: Tensor) -> Optional[Tuple[Tensor, List[int]]]:
    """x as ``(N, D)`` rows in memory order and the permutation of its dims that makes it contiguous, or
    None where x is not dense with its last dim innermost. ``(B, H, L, D)`` views of fairseq's ``(L, B, H*D)``
    projections are dense: read in place."""
    perm = sorted(range(x.dim()), key=lambda i: (x.stride(i), i), reverse=True)
    if perm[-1] != x.dim() - 1:
        return None
    p = x.permute(perm)
    return (p.view(-1, x.shape[-1]), perm) if p.is_contiguous() else None


def _launch(kernel, x: Tensor, *more: Tensor) -> None:
    N, D = x.shape
    BD = max(16, triton.next_power_of_2(D))
    rows = max(1, ELEMENTS // BD)
    with launching_on(x):
        kernel[(triton.cdiv(N, rows),)](x, *more, N, D, BD=BD, ROWS=rows, num_warps=4)


class _SiluNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        found = _rows(x)
        if found is None:
            x = x.contiguous()
            found = (x.view(-1, x.shape[-1]), list(range(x.dim())))
        rows, perm = found
        y = torch.empty_like(x)  # x's strides, since x is dense
        _launch(_silu_norm_forward, rows, y.permute(perm).view(-1, x.shape[-1]))
        ctx.save_for_backward(x)
        ctx.perm = perm
        return y

    @staticmethod
    @first_derivatives_only("the feature map's Triton kernel", "run without LION_BACKEND=triton")
    def backward(ctx, dy: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        if dy.stride() != x.stride():  # rows must pair up with x's in memory order
            dy = torch.empty_like(x).copy_(dy)
        dx = torch.empty_like(x)
        D = x.shape[-1]
        _launch(_silu_norm_backward, *(t.permute(ctx.perm).view(-1, D) for t in (x, dy, dx)))
        return dx


@eager_under_compile
def silu_norm_kernel(x: Tensor) -> Tensor:
    """``(silu(x) + 0.5) / ||silu(x) + 0.5||`` over the last dim, any shape, on CUDA (or on CPU under
    ``TRITON_INTERPRET=1``); float32, bfloat16 or float16; differentiable. Returns x's shape and dtype."""
    if x.numel() == 0:
        return x.clone()
    return _SiluNorm.apply(x)
