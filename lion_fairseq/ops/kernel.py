"""LION's own fused Triton kernel: both directions, the row normaliser, any decay, key padding, forward
and backward, reading q, k, v in their own dtype and layout.

Every direction is a *walk* over chunks of ``C`` tokens in that direction's order (the backward direction
walks right to left, reading the same tensors through reversed positions, so that it is the forward
direction on the reversed sequence). A walk carries the direction's ``Dk x Dv`` state ``S`` and ``Dk``
normaliser ``z`` in registers, in float32, and for each chunk adds the exact masked attention inside the
chunk to what the queries read from the state:

    frame positions p, log-gates g_p of the direction, a = cumsum(g) inside the chunk:
    y_i += sum_{j <= i in chunk} exp(a_i - a_j) (q_i . k_j) v_j  +  exp(a_i) q_i S
    S   <- exp(a_last) S + sum_j exp(a_last - a_j) k_j v_j^T

Every exponent is a sum of log-gates, so <= 0: nothing overflows at any L. The physical forward direction
keeps the diagonal; the backward one (gates ``log_a_bwd`` read in reverse) leaves it out. For the backward
direction in its reversed frame, ``M_ij = b_i ... b_{j-1}`` is exactly this mask with ``g_p = log b`` at
physical position ``L-1-p`` (no shift).

Parallelism: a walk over L tokens is sequential, so the sequence is cut into *segments* of chunks. One
small pass sums each segment's contribution to the state (``_segment_sums``), a matrix of decays turns
them into the state entering each segment (``_entering``, in PyTorch: at most a few hundred segments),
and then every segment walks on its own: ``B*H*segments`` programs whatever L is. The backward cuts the
sequence at the forward's segments, whose entering states then serve its walks along the same directions
(``_Entering``). A walk's steps wait on their chunk's q, k, v (and dy) rows, which Triton's pipeliner
leaves alone (they feed products and elementwise terms both); with ``PREFETCH`` each step loads the next
chunk's rows before computing its own (off until a GPU shows that it pays: ``benchmark.gpu_tune``).

The two directions meet in the normaliser, ``y = (n_fwd + n_bwd) / (d_fwd + d_bwd + eps)``: the first walk
leaves ``n/(d+eps)`` in y (in y's dtype: a weighted mean of v, so it needs no more range than y) and
``d`` in a float32 row buffer, the second reads them back and writes the result.

16-bit sums that another launch reads again are stored as pairs, the value rounded to the dtype and what
that rounding lost (``_store_sum``), which together keep about float32's digits: the first walk's part of
y, the final y where a backward will read it, and the backward's partial dq, dk, dv. Rounded to 16 bits
instead, they cost 3x in dq's error and 250x in the gates' (their gradients cancel against y). Memory
beyond the outputs: the row sums ``(B, H, L)``, the segments' states and, before a backward, y's second
half.

Backward: with ``do = dy/(d+eps)``, ``dden = -(dy . y)/(d+eps)`` (a pass of its own, ``_row_grads``) and
``dA_ij = do_i . v_j + dden_i``, ``dq_i = sum_j M_ij dA_ij k_j`` reads the forward state from the query's
side, while ``dk_j``, ``dv_j`` read a state ``G = sum_i q_i do_i^T`` from the other side. So each walk has
two parts: along, it carries the state of the direction it walks along and writes that direction's part
of dq (in the chunk and from the state); against, it carries the state ``G`` of the direction it walks
against and writes that direction's part of dk and dv (in the chunk, from the transposed scores, and from
G). That direction's mask in the walk's frame has the gates of the neighbouring position
(``log_a_bwd[t-1]`` walking right, ``log_a_fwd[t+1]`` walking left). A walk's two parts run from the
same tiles in one launch (``FUSED``: two launches in all, each reading q, k, v and dy once) or in one
launch each (four). Each gradient is written by two launches, one per direction, and the second adds to
the first's pair. The walks carry S and G transposed, as their products read them (dv is computed
transposed for that), so that no tensor-core result is transposed: Triton 3.4 to 3.7.0 miscompiled that on Hopper (fla #640).

Gate gradients: ``d loss / d log g_t = sum_{j < t <= i} P_ij`` with ``P_ij = M_ij (q_i . k_j) dA_ij``.
Per-token gates take it as a suffix sum of (row sum - column sum) of P, as the PyTorch chunk form does.
A per-head gate (LION-D: one gate broadcast over L) is the sum of that over L, where the rows and columns
cancel to a few parts in 1e4 at L = 8192; it is computed directly instead, as ``sum_{i > j} (i - j) P_ij``,
row by row: inside a chunk from P, and from earlier chunks through a second state
``S' = sum_j (distance to the chunk's end) * decay * k_j v_j^T`` that the walk carries beside S.

Products: float32 inputs multiply in TF32 where torch allows it for matmuls (``tf32_matmuls``), else
in three TF32 products each (``tf32x3``: about float32's accuracy, on tensor cores); 16-bit inputs multiply in their dtype on tensor cores with float32 accumulation, except that float16
products that read a state (whose entries grow with L past float16's range), take do (``dy/(d+eps)``,
past float16's range where a row sum is below eps, as in a padded row) or take the in-chunk scores (q.k of
unnormalised features passes 65504) run in float32. Under Triton's
CPU interpreter, which multiplies bfloat16 on its raw bits, bfloat16 products run in float32. Rounding
the operands shows where gradients are small residues of terms that cancel: in rows that are nearly their
own diagonal term (strong decay), dq comes out to 2e-3 of its size in float16 against the PyTorch form's
4e-4, and more under stronger decay (``docs/gpu.md``, "Where the gradients cancel")."""
import functools
import os
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .compiling import eager_under_compile
from .first_derivatives import first_derivatives_only
from .float32 import needs_grad

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_HEAD_DIM = 128
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the calls whose launches needed more of their GPU than it has, by (device, dtype, head sizes): why, so
# that later calls go straight to the fallback. Known only when Triton loads a kernel onto the GPU. Compiled
# for sm_89 (kernel_targets), float32 inputs at head size 128 need 160 to 192 KB of shared memory per block:
# more than an L4/L40S's 99 KB, and in the backward an A100's 163 KB (an H100/H200 has 227 KB); 16-bit
# inputs at 128, and float32 at 64 (sm_80), need at most 65 KB
_DOES_NOT_FIT: Dict[Tuple[str, torch.dtype, Tuple[int, int]], str] = {}


# ---------------------------------------------------------------------------------------------- helpers

@triton.jit
def _program(H):
    """This program's (batch x head) index (int64, for offsets past 2^31), its second grid index, and
    the batch and head it serves."""
    bh = tl.program_id(0).to(tl.int64)
    return bh, tl.program_id(1), bh // H, bh % H


@triton.jit
def _chunk_program(L, H, C: tl.constexpr):
    """As ``_program``, for a launch of one program per chunk of each (batch x head): all on the grid's
    first axis, since CUDA caps the others at 65535 programs (a million tokens in chunks of 16)."""
    n = tl.cdiv(L, C)
    pid = tl.program_id(0).to(tl.int64)
    bh = pid // n
    return bh, (pid % n).to(tl.int32), bh // H, bh % H


@triton.jit
def _positions(c, L, C: tl.constexpr, REVERSE: tl.constexpr):
    """Frame positions p of chunk c, their physical positions t, and whether those exist. Both frames cut
    the sequence at the same multiples of C (the reversed one starts with the last chunk's missing
    tokens), so that a pair of tokens shares a chunk in one walk exactly when it does in the other."""
    p = c * C + tl.arange(0, C)
    if REVERSE:
        t = tl.cdiv(L, C) * C - 1 - p
    else:
        t = p
    return p, (t < L) & (t >= 0), t


@triton.jit
def _before(t, valid, L, REVERSE: tl.constexpr):
    """The physical position of the frame's previous position, and whether it exists."""
    if REVERSE:
        tp = t + 1
        vp = valid & (tp < L)
    else:
        tp = t - 1
        vp = valid & (tp >= 0)
    return tp, vp


@triton.jit
def _tile(ptr, t, valid, stride_l, D, BD: tl.constexpr, COLS: tl.constexpr):
    """Pointers to the rows at t and their mask: a ``(C, BD)`` tile, or where ``COLS`` its transpose
    ``(BD, C)``. The mask is built first, in the order Triton emits a load's keyword and positional
    arguments: the compiled kernels stay the ones docs/gpu.md measured, registers included."""
    d = tl.arange(0, BD)
    if COLS:
        mask = valid[None, :] & (d[:, None] < D)
        ptrs = ptr + t[None, :] * stride_l + d[:, None]
    else:
        mask = valid[:, None] & (d[None, :] < D)
        ptrs = ptr + t[:, None] * stride_l + d[None, :]
    return ptrs, mask


@triton.jit
def _rows(ptr, t, valid, stride_l, D, BD: tl.constexpr, COLS: tl.constexpr = False):
    ptrs, mask = _tile(ptr, t, valid, stride_l, D, BD, COLS)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_rows(ptr, x, t, valid, stride_l, D, BD: tl.constexpr, COLS: tl.constexpr = False):
    ptrs, mask = _tile(ptr, t, valid, stride_l, D, BD, COLS)
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_sum(ptr, lo, t, valid, stride_l, D, BD: tl.constexpr, SPLIT: tl.constexpr, COLS: tl.constexpr = False):
    """Rows of a float32 sum stored as a pair (see ``_store_sum``): ptr's rows plus, when SPLIT, lo's; as
    the columns of a ``(BD, C)`` tile where ``COLS``."""
    x = _rows(ptr, t, valid, stride_l, D, BD, COLS).to(tl.float32)
    if SPLIT:
        x += _rows(lo, t, valid, stride_l, D, BD, COLS).to(tl.float32)
    return x


@triton.jit
def _store_sum(ptr, lo, x, t, valid, stride_l, D, BD: tl.constexpr, SPLIT: tl.constexpr,
               COLS: tl.constexpr = False):
    """Float32 rows x (the columns of x where ``COLS``) into ptr's dtype and, when SPLIT, what that rounding
    lost into lo (same dtype and strides): in 16 bits the pair keeps about as many digits as float32, for a
    sum that a later launch goes on adding to, or that the backward reads."""
    hi = x.to(ptr.dtype.element_ty)
    _store_rows(ptr, hi, t, valid, stride_l, D, BD, COLS)
    if SPLIT:
        _store_rows(lo, x - hi.to(tl.float32), t, valid, stride_l, D, BD, COLS)


@triton.jit
def _gates(ptr, t, valid, stride_l, HAS: tl.constexpr, C: tl.constexpr):
    if HAS:
        g = tl.load(ptr + t * stride_l, mask=valid, other=0.0).to(tl.float32)
    else:
        g = tl.zeros((C,), tl.float32)
    return g


@triton.jit
def _pad_bytes(pad, t, valid, stride_l, C: tl.constexpr, HAS_PAD: tl.constexpr):
    """The key padding mask at positions t (1 where absent), as loaded: a walk that loads the next chunk
    ahead (``PREFETCH``) must not wait on it, so it is compared only where it is used (``_keep``)."""
    if HAS_PAD:
        x = tl.load(pad + t * stride_l, mask=valid, other=1)
    else:
        x = tl.zeros((C,), tl.uint8)
    return x


@triton.jit
def _keep(valid, padb, HAS_PAD: tl.constexpr):
    """Positions whose key counts: present and not padding (``padb`` from ``_pad_bytes``)."""
    if HAS_PAD:
        keep = valid & (padb == 0)
    else:
        keep = valid
    return keep


@triton.jit
def _keys(pad, t, valid, stride_l, C: tl.constexpr, HAS_PAD: tl.constexpr):
    """Positions whose key counts: present and not padding."""
    return _keep(valid, _pad_bytes(pad, t, valid, stride_l, C, HAS_PAD), HAS_PAD)


@triton.jit
def _kept(k, v, valid, padb, HAS_PAD: tl.constexpr):
    """Positions whose key counts (``_keep``), and the key and value rows k, v zeroed elsewhere (both: a
    padded slot may hold inf or nan, which a zero weight would not cancel)."""
    keep = _keep(valid, padb, HAS_PAD)
    if HAS_PAD:
        k = tl.where(keep[:, None], k, tl.zeros_like(k))
        v = tl.where(keep[:, None], v, tl.zeros_like(v))
    return keep, k, v


@triton.jit
def _row_sums(den_ptr, dden_ptr, t, valid, C: tl.constexpr, NORMALIZE: tl.constexpr):
    """A chunk's float32 row sums d and their gradients dden (from ``_row_grads``), as loaded; zeros
    without the normaliser."""
    if NORMALIZE:
        # d = 1 past L: there dy = 0, and do = dy / (d + eps) must be 0 with eps = 0 too
        den = tl.load(den_ptr + t, mask=valid, other=1.0)
        dden = tl.load(dden_ptr + t, mask=valid, other=0.0)
    else:
        den = tl.zeros((C,), tl.float32)
        dden = tl.zeros((C,), tl.float32)
    return den, dden


@triton.jit
def _do(dy, den, eps, NORMALIZE: tl.constexpr):
    """The gradient w.r.t. the unnormalised output, ``do = dy / (d + eps)`` (dy without the normaliser), in
    float32."""
    do = dy.to(tl.float32)
    if NORMALIZE:
        do = do * (1.0 / (den + eps))[:, None]
    return do


@triton.jit
def _grad_rows(dy_ptr, den_ptr, dden_ptr, t, valid, sdy_l, Dv, eps, BV: tl.constexpr, C: tl.constexpr,
               NORMALIZE: tl.constexpr):
    """The gradients w.r.t. the unnormalised output (do) and the row sum (dden) of a chunk's rows."""
    dy = _rows(dy_ptr, t, valid, sdy_l, Dv, BV)
    den, dden = _row_sums(den_ptr, dden_ptr, t, valid, C, NORMALIZE)
    return _do(dy, den, eps, NORMALIZE), dden


@triton.jit
def _mm(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def _decays(g):
    """A chunk's cumulative log-gates ``a`` as float32 pairs ``hi + lo`` (summed in float64: in float32 a
    chunk of 64 strong gates loses 1e-5 in ``a_i - a_j`` near the diagonal, where it is small beside a),
    and its decays in float32: from its start to i ``exp(a_i)``, from j to its end ``exp(a_last - a_j)``,
    and across it ``exp(a_last)``."""
    a = tl.cumsum(g.to(tl.float64), 0)
    last = tl.sum(g.to(tl.float64), 0)
    hi = a.to(tl.float32)
    lo = (a - hi.to(tl.float64)).to(tl.float32)
    return hi, lo, tl.exp(hi), tl.exp((last - a).to(tl.float32)), tl.exp(last.to(tl.float32))


@triton.jit
def _in_chunk_decay(hi, lo, C: tl.constexpr, STRICT: tl.constexpr, HAS_GATE: tl.constexpr):
    """``W_ij = exp(a_i - a_j)`` for i >= j (i > j when STRICT), else 0, with ``a = hi + lo``. Below the
    diagonal ``a_i <= a_j <= 0``: where they are within a factor of 2 ``hi_i - hi_j`` is exact (Sterbenz),
    elsewhere the difference is as large as a_i, so float32 matrices give float64's accuracy."""
    i = tl.arange(0, C)[:, None]
    j = tl.arange(0, C)[None, :]
    if STRICT:
        lower = i > j
    else:
        lower = i >= j
    if HAS_GATE:
        d = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
        W = tl.exp(tl.where(lower, d, float("-inf")))
    else:
        W = tl.where(lower, 1.0, 0.0)
    return W


@triton.jit
def _load_state(ptr, z_ptr, idx, BK: tl.constexpr, BV: tl.constexpr, HAS: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """A state S ``(BK, BV)`` stored at ``idx``, or its transpose ``(BV, BK)`` (``TRANSPOSED``), and its
    normaliser z ``(BK,)``; zeros where not ``HAS``."""
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    if HAS:
        if TRANSPOSED:
            S = tl.load(ptr + idx * BK * BV + kk[None, :] * BV + vv[:, None])
        else:
            S = tl.load(ptr + idx * BK * BV + kk[:, None] * BV + vv[None, :])
        z = tl.load(z_ptr + idx * BK + kk)
    else:
        if TRANSPOSED:
            S = tl.zeros((BV, BK), tl.float32)
        else:
            S = tl.zeros((BK, BV), tl.float32)
        z = tl.zeros((BK,), tl.float32)
    return S, z


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def _segment_sums(X, YV, DY, DDEN, DEN, G, PAD, U, UZ, U1, UZ1, LOGD,
                  sx_b, sx_h, sx_l, syv_b, syv_h, syv_l, sdy_b, sdy_h, sdy_l,
                  sg_b, sg_h, sg_l, sp_b, sp_l, L, H, Dk, Dv, seg_chunks, eps,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
                  GRAD: tl.constexpr, HAS_GATE: tl.constexpr, HAS_PAD: tl.constexpr, MOMENTS: tl.constexpr,
                  NORMALIZE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """One segment's own contribution to a state at its end, in the walk's frame, and the sum of its
    log-gates. ``GRAD=False``: ``sum_j decay_j k_j v_j^T`` (keys X = k, YV = v, the direction's own gates).
    ``GRAD=True``: ``sum_i decay_i q_i do_i^T`` (X = q; do from DY, DEN, DDEN; the gates of the previous
    position). ``MOMENTS``: also the distance-weighted sums of a per-head gate's gradient."""
    bh, seg, b, h = _program(H)
    Xp = X + b * sx_b + h * sx_h
    Gp = G + b * sg_b + h * sg_h
    S = tl.zeros((BK, BV), tl.float32)
    z = tl.zeros((BK,), tl.float32)
    S1 = tl.zeros((BK, BV), tl.float32)
    z1 = tl.zeros((BK,), tl.float32)
    logd = tl.zeros((C,), tl.float32)
    dist = (C - 1 - tl.arange(0, C)).to(tl.float32)
    for i in range(seg_chunks):
        p, valid, t = _positions(seg * seg_chunks + i, L, C, REVERSE)
        if GRAD:
            tp, vp = _before(t, valid, L, REVERSE)
            g = _gates(Gp, tp, vp, sg_l, HAS_GATE, C)
            x = _rows(Xp, t, valid, sx_l, Dk, BK).to(tl.float32)
            y, w = _grad_rows(DY + b * sdy_b + h * sdy_h, DEN + bh * L, DDEN + bh * L, t, valid, sdy_l, Dv,
                              eps, BV, C, NORMALIZE)
        else:
            g = _gates(Gp, t, valid, sg_l, HAS_GATE, C)
            keep = _keys(PAD + b * sp_b, t, valid, sp_l, C, HAS_PAD)
            x = _rows(Xp, t, keep, sx_l, Dk, BK).to(tl.float32)
            y = _rows(YV + b * syv_b + h * syv_h, t, keep, syv_l, Dv, BV)
            w = tl.full((C,), 1.0, tl.float32)  # the normaliser's column of ones (x is 0 at padding)
        hi, lo, read, own, decay = _decays(g)
        xs = x * own[:, None]
        if MOMENTS:
            xd = xs * dist[:, None]
            S1 = decay * (S1 + C * S) + _mm(tl.trans(xd), y, DT, PREC)
            z1 = decay * (z1 + C * z) + tl.sum(xd * w[:, None], 0)
        S = decay * S + _mm(tl.trans(xs), y, DT, PREC)
        z = decay * z + tl.sum(xs * w[:, None], 0)
        logd += g
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    idx = bh * tl.num_programs(1) + seg
    tl.store(U + idx * BK * BV + kk[:, None] * BV + vv[None, :], S)
    tl.store(UZ + idx * BK + kk, z)
    if MOMENTS:
        tl.store(U1 + idx * BK * BV + kk[:, None] * BV + vv[None, :], S1)
        tl.store(UZ1 + idx * BK + kk, z1)
    tl.store(LOGD + idx, tl.sum(logd, 0))


@triton.jit
def _walk_tiles(Qp, Kp, Vp, Gp, PADp, c, L, sq_l, sk_l, sv_l, sg_l, sp_l, Dk, Dv, C: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr, HAS_GATE: tl.constexpr,
                HAS_PAD: tl.constexpr):
    """Chunk c's q, k, v rows, gates and padding, as loaded (nothing waits on them here: ``PREFETCH``)."""
    p, valid, t = _positions(c, L, C, REVERSE)
    return (_rows(Qp, t, valid, sq_l, Dk, BK), _rows(Kp, t, valid, sk_l, Dk, BK), _rows(Vp, t, valid, sv_l, Dv, BV),
            _gates(Gp, t, valid, sg_l, HAS_GATE, C), _pad_bytes(PADp, t, valid, sp_l, C, HAS_PAD))


@triton.jit
def _grad_tiles(Qp, Kp, Vp, DYp, DENp, DDENp, GAp, GBp, PADp, c, L, sq_l, sk_l, sv_l, sdy_l, sga_l, sgb_l, sp_l,
                Dk, Dv, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
                HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_PAD: tl.constexpr, NORMALIZE: tl.constexpr):
    """Chunk c's q, k, v, dy rows, row sums and their gradients, the gates walked along (at each position,
    where ``HAS_A``) and against (at the frame's previous position, where ``HAS_B``) and the padding, as
    loaded, for a backward walk."""
    p, valid, t = _positions(c, L, C, REVERSE)
    tp, vp = _before(t, valid, L, REVERSE)
    den, dden = _row_sums(DENp, DDENp, t, valid, C, NORMALIZE)
    return (_rows(Qp, t, valid, sq_l, Dk, BK), _rows(Kp, t, valid, sk_l, Dk, BK), _rows(Vp, t, valid, sv_l, Dv, BV),
            _rows(DYp, t, valid, sdy_l, Dv, BV), den, dden, _gates(GAp, t, valid, sga_l, HAS_A, C),
            _gates(GBp, tp, vp, sgb_l, HAS_B, C), _pad_bytes(PADp, t, valid, sp_l, C, HAS_PAD))


@triton.jit
def _forward_walk(Q, K, V, G, PAD, Y, YL, DEN, S0, Z0,
                  sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sy_b, sy_h, sy_l,
                  sg_b, sg_h, sg_l, sp_b, sp_l, L, H, Dk, Dv, seg_chunks, eps,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
                  STRICT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_PAD: tl.constexpr, HAS_STATE: tl.constexpr,
                  FIRST: tl.constexpr, NORMALIZE: tl.constexpr, LO_IN: tl.constexpr, LO_OUT: tl.constexpr,
                  DT: tl.constexpr, SDT: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr):
    """One direction over one segment: in-chunk attention plus what the queries read from the state.
    ``FIRST``: the first direction, its result left in Y (``n/(d+eps)``, or n) and DEN (d); otherwise that
    is read back and added. ``LO_IN``, ``LO_OUT``: Y is read, written, as a pair with YL (``_store_sum``).
    ``PREFETCH``: each step loads the next chunk's tiles before computing its own, so that their latency
    overlaps this step's products (Triton's pipeliner leaves these loads alone)."""
    bh, seg, b, h = _program(H)
    Qp = Q + b * sq_b + h * sq_h
    Kp = K + b * sk_b + h * sk_h
    Vp = V + b * sv_b + h * sv_h
    Yp = Y + b * sy_b + h * sy_h
    YLp = YL + b * sy_b + h * sy_h
    Gp = G + b * sg_b + h * sg_h
    DENp = DEN + bh * L
    S, z = _load_state(S0, Z0, bh * tl.num_programs(1) + seg, BK, BV, HAS_STATE, False)
    PADp = PAD + b * sp_b
    c0 = seg * seg_chunks
    if PREFETCH:
        qn, kn, vn, gn, padn = _walk_tiles(Qp, Kp, Vp, Gp, PADp, c0, L, sq_l, sk_l, sv_l, sg_l, sp_l, Dk, Dv, C, BK,
                                           BV, REVERSE, HAS_GATE, HAS_PAD)
    for i in range(seg_chunks):
        p, valid, t = _positions(c0 + i, L, C, REVERSE)
        if PREFETCH:
            q, k, v, g, padb = qn, kn, vn, gn, padn
            qn, kn, vn, gn, padn = _walk_tiles(Qp, Kp, Vp, Gp, PADp, c0 + i + 1, L, sq_l, sk_l, sv_l, sg_l, sp_l, Dk,
                                               Dv, C, BK, BV, REVERSE, HAS_GATE, HAS_PAD)
        else:
            q, k, v, g, padb = _walk_tiles(Qp, Kp, Vp, Gp, PADp, c0 + i, L, sq_l, sk_l, sv_l, sg_l, sp_l, Dk, Dv, C,
                                           BK, BV, REVERSE, HAS_GATE, HAS_PAD)
        keep, k, v = _kept(k, v, valid, padb, HAS_PAD)
        hi, lo, read, own, decay = _decays(g)
        A = _mm(q, tl.trans(k), DT, PREC) * _in_chunk_decay(hi, lo, C, STRICT, HAS_GATE)
        # SDT: float16 operands would overflow where q.k passes 65504
        num = _mm(A, v, SDT, PREC) + read[:, None] * _mm(q, S, SDT, PREC)
        den = tl.sum(A, 1) + read * tl.sum(q.to(tl.float32) * z[None, :], 1)
        ks = k.to(tl.float32) * own[:, None]
        S = decay * S + _mm(tl.trans(ks), v, DT, PREC)
        z = decay * z + tl.sum(ks, 0)
        if not FIRST:
            before = _load_sum(Yp, YLp, t, valid, sy_l, Dv, BV, LO_IN)
            if NORMALIZE:
                den_before = tl.load(DENp + t, mask=valid, other=0.0)
                # where the first walk met no key, n = 0: 0/0 with eps = 0, so select rather than scale
                num += tl.where((den_before + eps)[:, None] != 0, before * (den_before + eps)[:, None], 0.0)
                den += den_before
            else:
                num += before
        if NORMALIZE:
            _store_sum(Yp, YLp, num / (den + eps)[:, None], t, valid, sy_l, Dv, BV, LO_OUT)
            tl.store(DENp + t, den, mask=valid)
        else:
            _store_sum(Yp, YLp, num, t, valid, sy_l, Dv, BV, LO_OUT)


@triton.jit
def _backward_walk(Q, K, V, DY, DDEN, DEN, GA, GB, PAD, S0, Z0, S10, Z10, G0, GZ0, DQ, DK, DV, DQL, DKL, DVL,
                   RCA, RCB, MOM, sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sdy_b, sdy_h, sdy_l,
                   sdq_b, sdq_h, sdq_l, sdk_b, sdk_h, sdk_l, sdv_b, sdv_h, sdv_l,
                   sga_b, sga_h, sga_l, sgb_b, sgb_h, sgb_l, sp_b, sp_l, L, H, Dk, Dv, seg_chunks, eps,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
                   ALONG: tl.constexpr, AGAINST: tl.constexpr, GATE_A: tl.constexpr, GATE_B: tl.constexpr,
                   HAS_PAD: tl.constexpr, S_IN: tl.constexpr, M_IN: tl.constexpr, G_IN: tl.constexpr,
                   NORMALIZE: tl.constexpr, DCUM_A: tl.constexpr, DCUM_B: tl.constexpr, MOMENTS: tl.constexpr,
                   P_SUMS: tl.constexpr, FIRST: tl.constexpr, LO_IN: tl.constexpr, LO_OUT: tl.constexpr,
                   DT: tl.constexpr, SDT: tl.constexpr, GDT: tl.constexpr, PREC: tl.constexpr,
                   PREFETCH: tl.constexpr):
    """One walk's gradients over one segment: one of its two parts or both (``ALONG``, ``AGAINST``), from
    the same tiles. ``ALONG``: the direction walked along (gates GA where ``GATE_A``): dq, in the chunk and
    from the state S, and the gate sums. ``AGAINST``: the one walked against (gates GB where ``GATE_B``,
    read at the previous position): dk and dv, in the chunk and from the state G of the queries of
    earlier chunks. The forward direction keeps the diagonal in the chunk, the backward one leaves it out:
    walking right (``REVERSE`` false) the part along keeps it, walking left the part against. ``FIRST``:
    the first launch to write these gradients, else what is in DQ (DK, DV) is added to; those are float32
    sums kept as pairs with DQL (DKL, DVL) (``_store_sum``): read when ``LO_IN``, written when ``LO_OUT``.
    GDT: the dtype of the products with do (float16's range is too small for do = dy / (d + eps) where d
    is small, as in a padded row). RCA, RCB: row minus column sums of P per position (per-token gates),
    MOM: the per-head gate's gradient of the segment (along direction); ``P_SUMS``: either of the first
    two is wanted. ``S_IN``, ``M_IN``, ``G_IN``: the segment's entering states S, S', G are read (else
    zero). ``PREFETCH``: as in ``_forward_walk``."""
    bh, seg, b, h = _program(H)
    Qp = Q + b * sq_b + h * sq_h
    Kp = K + b * sk_b + h * sk_h
    Vp = V + b * sv_b + h * sv_h
    DQp, DQLp = DQ + b * sdq_b + h * sdq_h, DQL + b * sdq_b + h * sdq_h
    DKp, DKLp = DK + b * sdk_b + h * sdk_h, DKL + b * sdk_b + h * sdk_h
    DVp, DVLp = DV + b * sdv_b + h * sdv_h, DVL + b * sdv_b + h * sdv_h
    idx = bh * tl.num_programs(1) + seg
    # the states are carried as their products read them, transposed: Triton 3.4 to 3.7.0 computed wrong
    # products on Hopper from a transposed tensor-core result (fla #640), which S and G are
    ST, z = _load_state(S0, Z0, idx, BK, BV, S_IN, True)
    S1T, z1 = _load_state(S10, Z10, idx, BK, BV, M_IN, True)
    GsT, gz = _load_state(G0, GZ0, idx, BK, BV, G_IN, True)
    ii = tl.arange(0, C)[:, None]
    jj = tl.arange(0, C)[None, :]
    pos = tl.arange(0, C).to(tl.float32)
    mom = tl.zeros((C,), tl.float32)
    DYp = DY + b * sdy_b + h * sdy_h
    PADp = PAD + b * sp_b
    GAp = GA + b * sga_b + h * sga_h  # the gates of this walk's direction, at each position
    GBp = GB + b * sgb_b + h * sgb_h  # the other direction's, at the frame's previous position
    c0 = seg * seg_chunks
    if PREFETCH:
        qn, kn, vn, dyn, denn, ddenn, gan, gbn, padn = _grad_tiles(
            Qp, Kp, Vp, DYp, DEN + bh * L, DDEN + bh * L, GAp, GBp, PADp, c0, L, sq_l, sk_l, sv_l, sdy_l, sga_l,
            sgb_l, sp_l, Dk, Dv, C, BK, BV, REVERSE, GATE_A, GATE_B, HAS_PAD, NORMALIZE)
    for i in range(seg_chunks):
        p, valid, t = _positions(c0 + i, L, C, REVERSE)
        if PREFETCH:
            q, k, v, dy, den, dden, ga, gb, padb = qn, kn, vn, dyn, denn, ddenn, gan, gbn, padn
            qn, kn, vn, dyn, denn, ddenn, gan, gbn, padn = _grad_tiles(
                Qp, Kp, Vp, DYp, DEN + bh * L, DDEN + bh * L, GAp, GBp, PADp, c0 + i + 1, L, sq_l, sk_l, sv_l, sdy_l,
                sga_l, sgb_l, sp_l, Dk, Dv, C, BK, BV, REVERSE, GATE_A, GATE_B, HAS_PAD, NORMALIZE)
        else:
            q, k, v, dy, den, dden, ga, gb, padb = _grad_tiles(
                Qp, Kp, Vp, DYp, DEN + bh * L, DDEN + bh * L, GAp, GBp, PADp, c0 + i, L, sq_l, sk_l, sv_l, sdy_l,
                sga_l, sgb_l, sp_l, Dk, Dv, C, BK, BV, REVERSE, GATE_A, GATE_B, HAS_PAD, NORMALIZE)
        keep, k, v = _kept(k, v, valid, padb, HAS_PAD)
        do = _do(dy, den, eps, NORMALIZE)
        if ALONG:
            hi, lo, read, own, decay = _decays(ga)
            W = _in_chunk_decay(hi, lo, C, REVERSE, GATE_A)
            A = _mm(q, tl.trans(k), DT, PREC) * W
            dA = _mm(do, tl.trans(v), GDT, PREC) + dden[:, None]
            dq_in = read[:, None] * (_mm(do, ST, SDT, PREC) + dden[:, None] * z[None, :])
            dq = _mm(dA * W, k, GDT, PREC) + dq_in
            if not FIRST:
                dq += _load_sum(DQp, DQLp, t, valid, sdq_l, Dk, BK, LO_IN)
            _store_sum(DQp, DQLp, dq, t, valid, sdq_l, Dk, BK, LO_OUT)
            if P_SUMS:
                qf = q.to(tl.float32)
                P = tl.where(ii > jj, A * dA, 0.0)  # the diagonal crosses no gate
                gain = tl.sum(qf * dq_in, 1)  # P summed over the keys of earlier chunks
                if DCUM_A:
                    tl.store(RCA + bh * L + t, tl.sum(P, 1) - tl.sum(P, 0) + gain, mask=valid)
                if MOMENTS:
                    far = read[:, None] * (_mm(do, S1T, SDT, PREC) + dden[:, None] * z1[None, :])
                    mom += tl.sum(P * (ii - jj).to(tl.float32), 1) + (pos + 1) * gain + tl.sum(qf * far, 1)
            ks = k.to(tl.float32) * own[:, None]
            if MOMENTS:
                kd = ks * (C - 1 - pos)[:, None]
                S1T = decay * (S1T + C * ST) + _mm(tl.trans(v), kd, DT, PREC)
                z1 = decay * (z1 + C * z) + tl.sum(kd, 0)
            ST = decay * ST + _mm(tl.trans(v), ks, DT, PREC)
            z = decay * z + tl.sum(ks, 0)
        if AGAINST:
            hi, lo, read, own, decay = _decays(gb)
            # in the chunk, keys j (rows) read queries i <= j (columns) of this frame: the transpose of
            # what the other walk's along part computes for dq
            W = _in_chunk_decay(hi, lo, C, not REVERSE, GATE_B)
            AT = _mm(q, tl.trans(k), DT, PREC) * tl.trans(W)  # the scores' transpose, queries by keys
            dA = _mm(v, tl.trans(do), GDT, PREC) + dden[None, :]
            dk_in = read[:, None] * (_mm(v, GsT, SDT, PREC) + gz[None, :])
            if DCUM_B:  # minus P summed over the queries of earlier chunks (zero at padded keys)
                tl.store(RCB + bh * L + t, -tl.sum(k.to(tl.float32) * dk_in, 1), mask=valid)
            dk = _mm(dA * W, q, GDT, PREC) + dk_in
            # dv transposed, (Dv, C): so G is read transposed only, and carried so
            dvT = _mm(tl.trans(do), AT, GDT, PREC) + read[None, :] * _mm(GsT, tl.trans(k), SDT, PREC)
            if not FIRST:
                dk += _load_sum(DKp, DKLp, t, valid, sdk_l, Dk, BK, LO_IN)
                dvT += _load_sum(DVp, DVLp, t, valid, sdv_l, Dv, BV, LO_IN, True)
            _store_sum(DKp, DKLp, tl.where(keep[:, None], dk, 0.0), t, valid, sdk_l, Dk, BK, LO_OUT)
            _store_sum(DVp, DVLp, dvT, t, valid, sdv_l, Dv, BV, LO_OUT, True)
            qs = q.to(tl.float32) * own[:, None]
            GsT = decay * GsT + _mm(tl.trans(do), qs, GDT, PREC)
            gz = decay * gz + tl.sum(qs * dden[:, None], 0)
    if MOMENTS:
        tl.store(MOM + idx, tl.sum(mom, 0))


@triton.jit
def _global_apply(Q, K, V, DY, Y, YL, DEN, DDEN, PAD, S0, Z0, G0, GZ0, DQ, DK, DV,
                  sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sdy_b, sdy_h, sdy_l, sy_b, sy_h, sy_l,
                  sdq_b, sdq_h, sdq_l, sdk_b, sdk_h, sdk_l, sdv_b, sdv_h, sdv_l, sp_b, sp_l, L, H, Dk, Dv, eps,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GRAD: tl.constexpr,
                  HAS_PAD: tl.constexpr, NORMALIZE: tl.constexpr, LO_OUT: tl.constexpr, SDT: tl.constexpr,
                  PREC: tl.constexpr):
    """Bidirectional attention without decay (LION-LIT): every query reads the one total state.
    ``GRAD=False``: y = q S / (q . z + eps) (or q S), with YL when ``LO_OUT``; ``GRAD=True``: dq from
    (S, z), dk and dv from the total (G, gz) of the queries' side. One program per chunk."""
    bh, c, b, h = _chunk_program(L, H, C)
    p, valid, t = _positions(c, L, C, False)
    if GRAD:  # each state loaded as its product reads it, just before (the queries' total G both ways)
        keep = _keys(PAD + b * sp_b, t, valid, sp_l, C, HAS_PAD)
        k = _rows(K + b * sk_b + h * sk_h, t, keep, sk_l, Dk, BK)
        v = _rows(V + b * sv_b + h * sv_h, t, keep, sv_l, Dv, BV)
        do, dden = _grad_rows(DY + b * sdy_b + h * sdy_h, DEN + bh * L, DDEN + bh * L, t, valid, sdy_l, Dv, eps,
                              BV, C, NORMALIZE)
        ST, z = _load_state(S0, Z0, bh, BK, BV, True, True)
        dq = _mm(do, ST, SDT, PREC) + dden[:, None] * z[None, :]
        _store_rows(DQ + b * sdq_b + h * sdq_h, dq, t, valid, sdq_l, Dk, BK)
        GsT, gz = _load_state(G0, GZ0, bh, BK, BV, True, True)
        dk = tl.where(keep[:, None], _mm(v, GsT, SDT, PREC) + gz[None, :], 0.0)
        _store_rows(DK + b * sdk_b + h * sdk_h, dk, t, valid, sdk_l, Dk, BK)
        Gs, _ = _load_state(G0, GZ0, bh, BK, BV, True, False)
        dv = _mm(k, Gs, SDT, PREC)
        _store_rows(DV + b * sdv_b + h * sdv_h, dv, t, valid, sdv_l, Dv, BV)
    else:
        S, z = _load_state(S0, Z0, bh, BK, BV, True, False)
        q = _rows(Q + b * sq_b + h * sq_h, t, valid, sq_l, Dk, BK)
        num = _mm(q, S, SDT, PREC)
        Yp = Y + b * sy_b + h * sy_h
        YLp = YL + b * sy_b + h * sy_h
        if NORMALIZE:
            den = tl.sum(q.to(tl.float32) * z[None, :], 1)
            _store_sum(Yp, YLp, num / (den + eps)[:, None], t, valid, sy_l, Dv, BV, LO_OUT)
            tl.store(DEN + bh * L + t, den, mask=valid)
        else:
            _store_sum(Yp, YLp, num, t, valid, sy_l, Dv, BV, LO_OUT)


@triton.jit
def _row_grads(DY, Y, YL, DEN, DDEN, sdy_b, sdy_h, sdy_l, sy_b, sy_h, sy_l, L, H, Dv, eps,
               C: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr):
    """The row sums' gradient ``dden = -(dy . y) / (d + eps)``, once per row before the backward's walks.
    y is read as the forward left it, a pair when SPLIT: every ``dA_ij = do_i . (v_j - y_i)`` cancels
    against y, and so do the gates' gradients, which y rounded to 16 bits missed by 1% (relative RMS).
    One program per chunk."""
    bh, c, b, h = _chunk_program(L, H, C)
    p, valid, t = _positions(c, L, C, False)
    dy = _rows(DY + b * sdy_b + h * sdy_h, t, valid, sdy_l, Dv, BV).to(tl.float32)
    y = _load_sum(Y + b * sy_b + h * sy_h, YL + b * sy_b + h * sy_h, t, valid, sy_l, Dv, BV, SPLIT)
    den = tl.load(DEN + bh * L + t, mask=valid, other=0.0)
    tl.store(DDEN + bh * L + t, -tl.sum(dy * y, 1) / (den + eps), mask=valid)


# ---------------------------------------------------------------------------------------------- launches

@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs(x: Tensor) -> int:
    """How many programs a walk's launch should have on x's device, over all batches and heads: on a GPU
    ``PROGRAMS_PER_SM`` per streaming multiprocessor; elsewhere (the interpreter) one per batch and head."""
    return PROGRAMS_PER_SM * _processors(x.device) if x.is_cuda else 1


# (largest chunk, warps) by the head's block size, forward and backward: the largest chunk whose walks
# compile for sm_90 with no registers spilled (python -m lion_fairseq.ops.kernel_targets, docs/gpu.md): with
# chunks of 64 and 4 warps the walks spilled up to 0.5 KB per thread forward and 3.9 KB backward at D = 64
BLOCKS = {False: {64: (32, 8), 128: (16, 8)}, True: {64: (16, 8), 128: (16, 8)}}
# a walk is cut into segments until there are about this many programs per streaming multiprocessor (see
# ``benchmark.gpu_tune`` for how this and ``BLOCKS`` are tuned on a GPU)
PROGRAMS_PER_SM = 4
# software-pipelining stages of the walks' loops, forward and backward (3: Triton's default on NVIDIA GPUs)
STAGES = {False: 3, True: 3}
# whether the walks load the next chunk's tiles before computing their own, forward and backward (bf16
# spills no registers either way on sm_90 at D = 64, Triton 3.6.0; not yet timed on a GPU)
PREFETCH = {False: False, True: False}
# whether a bidirectional backward walks each way once with both of its parts (two launches), by head
# class, instead of once per part (four launches, each reading q, k, v and dy again): ``_backward_passes``.
# Compiled for sm_90 at the backward's (16, 8), fused walks spill nothing with bf16 inputs and up to 224
# bytes a thread with fp16 at D = 64 (368 and 400 at D = 32) (kernel_targets, Triton 3.9.0); at D = 128
# more than split ones (bf16: 560 bytes against 400, Triton 3.6.0)
FUSED = {64: True, 128: False}


def tf32_matmuls() -> bool:
    """Whether torch lets float32 matmuls on CUDA run in TF32: ``torch.backends.cuda.matmul.fp32_precision``
    where torch has it (2.9 on), which follows both ways of setting it; reading ``allow_tf32`` there raises
    once the new way was used."""
    matmul = torch.backends.cuda.matmul
    try:
        precision = matmul.fp32_precision
    except (AttributeError, AssertionError):  # before 2.9 it has none; before 2.2 asking raised AssertionError
        precision = "none"
    if precision != "none":
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # a mix of the two ways that torch does not resolve: its default, IEEE
        return False


def head_class(D: int) -> int:
    """The key of ``BLOCKS`` that a head size (or its block) D falls under."""
    return 64 if D <= 64 else 128


@contextmanager
def configured(D: int = 64, forward: Optional[Tuple[int, int]] = None, backward: Optional[Tuple[int, int]] = None,
               programs: Optional[int] = None, stages: Optional[Tuple[int, int]] = None,
               prefetch: Optional[Tuple[bool, bool]] = None, fused: Optional[bool] = None) -> Iterator[None]:
    """Inside the block, the kernel takes (chunk, warps) ``forward`` and ``backward`` at head size D,
    ``programs`` per streaming multiprocessor, (forward, backward) ``stages`` and ``prefetch``, and
    ``fused`` backward walks at head size D (None: as it ships); afterwards, what it took before. For
    tuning (``benchmark.gpu_tune``) and compiling (``kernel_targets``) other configurations than the
    shipped one."""
    global PROGRAMS_PER_SM
    saved = ({pas: dict(by_head) for pas, by_head in BLOCKS.items()}, PROGRAMS_PER_SM, dict(STAGES), dict(PREFETCH),
             dict(FUSED))
    try:
        for pas, blocks in ((False, forward), (True, backward)):
            if blocks is not None:
                BLOCKS[pas][head_class(D)] = tuple(blocks)
        if programs is not None:
            PROGRAMS_PER_SM = programs
        if stages is not None:
            STAGES.update({False: stages[0], True: stages[1]})
        if prefetch is not None:
            PREFETCH.update({False: bool(prefetch[0]), True: bool(prefetch[1])})
        if fused is not None:
            FUSED[head_class(D)] = bool(fused)
        yield
    finally:
        for pas, by_head in saved[0].items():
            BLOCKS[pas].clear()
            BLOCKS[pas].update(by_head)
        PROGRAMS_PER_SM = saved[1]
        STAGES.update(saved[2])
        PREFETCH.update(saved[3])
        FUSED.update(saved[4])


class _Config:
    """Block sizes, segments and product dtypes of one pass (``backward`` or not) of a call."""

    def __init__(self, q: Tensor, v: Tensor, chunk_size: int, segment_chunks: Optional[int],
                 backward: bool = False):
        B, H, L, Dk = q.shape
        self.B, self.H, self.L, self.Dk, self.Dv = B, H, L, Dk, v.shape[-1]
        self.BK = max(16, triton.next_power_of_2(Dk))
        self.BV = max(16, triton.next_power_of_2(self.Dv))
        largest, self.num_warps = BLOCKS[backward][head_class(max(self.BK, self.BV))]
        self.num_stages = STAGES[backward]
        # float32 inputs keep a launch per part: fused, their walks spilled up to 0.7 KB a thread (3xTF32
        # products, sm_90, kernel_targets; measured before the walks carried their states transposed)
        self.fused = FUSED[head_class(max(self.BK, self.BV))] and q.dtype != torch.float32
        if INTERPRETED:  # no registers to spare there, and a step costs the same at any chunk: take fewer steps
            largest = 64
        # chunks are a power of two for tl.arange and at least 16 for tl.dot; the C x C temporaries and the
        # states live in registers. The result does not depend on C.
        self.C = min(largest, max(16, triton.next_power_of_2(chunk_size)))
        N = triton.cdiv(L, self.C)
        if segment_chunks is None:  # the same programs per streaming multiprocessor, whatever L is
            programs = _programs(q) // (B * H)
            segment_chunks = triton.cdiv(N, max(1, min(N, programs)))
        self.Q = max(1, segment_chunks)
        self.nseg = triton.cdiv(N, self.Q)
        interpreted_bf16 = INTERPRETED and q.dtype == torch.bfloat16
        self.DT = tl.float32 if q.dtype == torch.float32 or interpreted_bf16 else (
            tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
        self.SDT = tl.bfloat16 if self.DT == tl.bfloat16 else tl.float32  # float16 states would overflow
        # and so would float16 products with do = dy / (d + eps), where a row sum d is small
        self.GDT = tl.float32 if self.DT == tl.float16 else self.DT
        self.SPLIT = q.dtype != torch.float32  # 16-bit sums that a later launch reads are kept as pairs
        tf32 = q.dtype != torch.float32 or (q.is_cuda and tf32_matmuls())
        # float32 without TF32: three TF32 tensor-core products each (about float32's accuracy); IEEE
        # products are not tensor-core dots, and spilled 3.3-4.9 KB a thread on sm_90 (kernel_targets)
        self.PREC = "ieee" if INTERPRETED else "tf32" if tf32 else "tf32x3"

    def consts(self) -> dict:
        return dict(C=self.C, BK=self.BK, BV=self.BV, PREC=self.PREC, num_warps=self.num_warps,
                    num_stages=self.num_stages)


def _addressable(x: Tensor) -> Tensor:
    """x ``(B, H, L, D)``, or a contiguous copy where its last dim is strided or its rows reach 2^31
    elements past their (batch, head) start: the kernel adds row offsets in 32 bits (the batch and head
    offsets in 64), and a view of fairseq's ``T x B x C`` layout puts B*C elements between rows."""
    far = (x.shape[2] - 1) * x.stride(2) + x.shape[3] >= 2 ** 31
    return x.contiguous() if far or x.stride(-1) != 1 else x


def _s3(x: Optional[Tensor]) -> Tuple[int, int, int]:
    """(b, h, l) strides of a ``(B, H, L, ...)`` tensor, 0 along any broadcast (size-1) dim."""
    if x is None:
        return 0, 0, 0
    return tuple(x.stride(i) if x.shape[i] > 1 else 0 for i in range(3))


def _pad_strides(pad: Optional[Tensor]) -> Tuple[int, int]:
    return (pad.stride(0), pad.stride(1)) if pad is not None else (0, 0)


def _entering(U: Tensor, UZ: Tensor, logd: Tensor, seg_tokens: int, U1: Optional[Tensor] = None,
              UZ1: Optional[Tensor] = None) -> List[Tensor]:
    """Segments' own sums ``(BH, n, ...)`` -> the states entering each segment:
    ``E_s = sum_{s' < s} exp(sum of the log-decays of the segments between) U_s'``, one batched matmul
    (exponents <= 0; cumulative sums in float64). With the moments of a per-head gate, also
    ``E'_s = sum_{s'<s} W_ss' (U'_s' + (tokens between) U_s')``."""
    BH, n = logd.shape
    lam = logd.double().cumsum(1)
    s = torch.arange(n, device=logd.device)
    before = s[None, :] < s[:, None]
    W = (F.pad(lam[:, :-1], (1, 0))[:, :, None] - lam[:, None, :]).masked_fill(~before, float("-inf"))
    W = W.exp().float()
    out = [torch.bmm(W, U.view(BH, n, -1)).view_as(U), torch.bmm(W, UZ)]
    if U1 is not None:
        Wd = W * ((s[:, None] - s[None, :] - 1).clamp(min=0) * seg_tokens).float()
        out += [torch.bmm(W, U1.view(BH, n, -1)).add_(torch.bmm(Wd, U.view(BH, n, -1))).view_as(U1),
                torch.bmm(W, UZ1).add_(torch.bmm(Wd, UZ))]
    return out


def _segment_states(cfg: _Config, reverse: bool, gates: Optional[Tensor], pad: Optional[Tensor], k: Tensor,
                    v: Tensor, moments: bool = False, grad: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]] = None,
                    normalize: bool = True, eps: float = 0.0, entering: bool = True) -> List[Tensor]:
    """States entering each segment of a walk (``entering``), or each segment's own sums, and their
    normalisers: of the keys ``k, v`` with the direction's gates, or (``grad = (q, dy, dden, den)``) of the
    queries' gradients with the gates of the previous position; plus the moments when asked."""
    BH, n, BK, BV = cfg.B * cfg.H, cfg.nseg, cfg.BK, cfg.BV
    dev = k.device
    U = torch.empty(BH, n, BK, BV, dtype=torch.float32, device=dev)
    UZ = torch.empty(BH, n, BK, dtype=torch.float32, device=dev)
    U1, UZ1 = (torch.empty_like(U), torch.empty_like(UZ)) if moments else (U, UZ)
    logd = torch.empty(BH, n, dtype=torch.float32, device=dev)
    x, yv, dy, dden, den = (grad[0], v, grad[1], grad[2], grad[3]) if grad is not None else (k, v, v, U, U)
    _segment_sums[(BH, n)](
        x, yv, dy, dden, den, gates if gates is not None else U, pad if pad is not None else U,
        U, UZ, U1, UZ1, logd, *_s3(x), *_s3(yv), *_s3(dy), *_s3(gates), *_pad_strides(pad),
        cfg.L, cfg.H, cfg.Dk, cfg.Dv, cfg.Q, eps, REVERSE=reverse, GRAD=grad is not None,
        HAS_GATE=gates is not None, HAS_PAD=pad is not None, MOMENTS=moments, NORMALIZE=normalize,
        DT=cfg.GDT if grad is not None else cfg.DT, **cfg.consts())
    if not entering:
        return [U, UZ]
    return _entering(U, UZ, logd, cfg.Q * cfg.C, *((U1, UZ1) if moments else ()))


class _Entering(NamedTuple):
    """The states entering each segment of the forward's walks, by direction (walking left or not), for
    the backward's walks along the same directions to reuse where they cut the sequence alike: segments of
    ``tokens`` tokens, in frames of ``padded`` positions (the reversed frame starts with the last chunk's
    missing tokens)."""
    tokens: int
    padded: int
    states: Dict[bool, List[Tensor]]


def _forward(cfg: _Config, q: Tensor, k: Tensor, v: Tensor, f: Optional[Tensor], b: Optional[Tensor],
             pad: Optional[Tensor], causal: bool, normalize: bool, eps: float, keep: bool):
    """Returns y ``(B, H, L, Dv)`` in v's dtype; what y's rounding lost, in the same dtype, where the
    backward reads y (``keep``) and y is 16-bit (else None); the row sums ``(B*H, L)`` float32 (or None);
    the total state of a bidirectional call without gates (or None); and the walks' ``_Entering``
    states (or None)."""
    B, H, L = cfg.B, cfg.H, cfg.L
    # in v's layout: for a view of fairseq's (L, B, H*D) projection, y's (L, B, H*D) view is then free
    y = torch.empty_like(v, memory_format=torch.preserve_format)
    den = torch.empty(B * H, L, dtype=torch.float32, device=v.device) if normalize else y
    lit = not causal and f is None and b is None
    walks = [] if lit else [(False, f)] if causal else [(True, b), (False, f)]
    # the first of two walks leaves its part for the second to add to: a pair, like what the backward keeps
    lo = torch.empty_like(y) if cfg.SPLIT and (keep or len(walks) == 2) else None
    common = (*_s3(q), *_s3(k), *_s3(v), *_s3(y))
    if lit:  # LION-LIT: one state for every query
        S, z = (x.sum(1) for x in _segment_states(cfg, False, None, pad, k, v, entering=False))
        _global_apply[(B * H * triton.cdiv(L, cfg.C),)](
            q, k, v, v, y, lo if lo is not None else y, den, den, pad if pad is not None else y, S, z, S, z, y, y, y,
            *common, *_s3(y), *_s3(y), *_s3(y), *_s3(y), *_pad_strides(pad), L, H, cfg.Dk, cfg.Dv, eps,
            GRAD=False, HAS_PAD=pad is not None, NORMALIZE=normalize, LO_OUT=lo is not None, SDT=cfg.SDT,
            **cfg.consts())
        return y, lo, (den if normalize else None), (S, z), None
    entering = _Entering(cfg.Q * cfg.C, triton.cdiv(L, cfg.C) * cfg.C, {})
    for n, (reverse, g) in enumerate(walks):
        state = (_segment_states(cfg, reverse, g, pad, k, v) if cfg.nseg > 1 else [y, y])
        if cfg.nseg > 1:
            entering.states[reverse] = state
        _forward_walk[(B * H, cfg.nseg)](
            q, k, v, g if g is not None else y, pad if pad is not None else y, y, lo if lo is not None else y, den,
            *state, *common, *_s3(g), *_pad_strides(pad), L, H, cfg.Dk, cfg.Dv, cfg.Q, eps,
            REVERSE=reverse, STRICT=reverse, HAS_GATE=g is not None, HAS_PAD=pad is not None,
            HAS_STATE=cfg.nseg > 1, FIRST=n == 0, NORMALIZE=normalize, LO_IN=lo is not None and n > 0,
            LO_OUT=lo is not None and (keep or n < len(walks) - 1), DT=cfg.DT, SDT=cfg.SDT,
            PREFETCH=PREFETCH[False], **cfg.consts())
    return y, (lo if keep else None), (den if normalize else None), None, entering


def _per_head(g: Optional[Tensor]) -> bool:
    return g is not None and g.shape[-1] == 1


def _backward_config(q: Tensor, v: Tensor, chunk_size: int, segment_chunks: Optional[int],
                     forward_tokens: Optional[int]) -> _Config:
    """The backward's configuration: unless the call fixed the chunks per segment, the forward's segments
    of ``forward_tokens`` tokens (None: it had one) where its chunks divide them, so that the forward's
    states serve the walks along the same directions."""
    cfg = _Config(q, v, chunk_size, segment_chunks, backward=True)
    if forward_tokens is not None and segment_chunks is None and forward_tokens % cfg.C == 0:
        cfg = _Config(q, v, chunk_size, forward_tokens // cfg.C, backward=True)
    return cfg


def _forward_states(cfg: _Config, entering: Optional[_Entering], reverse: bool) -> Optional[List[Tensor]]:
    """The forward's states entering the segments of the walk in this direction (``reverse``: walking
    left), where the backward's segments are the same tokens in the same frame; else None."""
    if entering is None or reverse not in entering.states or cfg.Q * cfg.C != entering.tokens:
        return None
    if reverse and triton.cdiv(cfg.L, cfg.C) * cfg.C != entering.padded:
        return None
    return entering.states[reverse]


def _backward_passes(causal: bool, fused: bool) -> List[Tuple[bool, bool, bool]]:
    """The backward's launches, as (walking left, along part, against part). Walking right, the forward
    direction is walked along (its part of dq, in the chunk and from the state) and the backward one
    against (its part of dk and dv); walking left, the other way round. A causal call has no backward
    direction: it walks right along and left against, and writes each gradient once. A bidirectional one
    walks both ways, and each gradient is written by two launches, the first of which leaves a 16-bit pair
    (``_store_sum``): the two parts cancel (dq is orthogonal to q, for one), and rounding the first to 16
    bits cost 3x in dq's accuracy. ``fused``: each walk does both parts from the same tiles, in two
    launches instead of four; else dq's two launches run first, so that its pair's second half is gone
    before dk's and dv's are made (less memory, more reads)."""
    if causal:
        return [(False, True, False), (True, False, True)]
    if fused:
        return [(False, True, True), (True, True, True)]
    return [(False, True, False), (True, True, False), (False, False, True), (True, False, True)]


def _backward(cfg: _Config, q, k, v, f, b, pad, y, y_lo, den, total, dy, causal: bool, normalize: bool,
              eps: float, needs: Tuple[bool, ...], entering: Optional[_Entering] = None):
    B, H, L = cfg.B, cfg.H, cfg.L
    BH = B * H
    # in their inputs' layouts: the gradients of fairseq's (L, B, H*D) projections need no copy
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.preserve_format) for x in (q, k, v))
    if normalize:
        dden = torch.empty(BH, L, dtype=torch.float32, device=q.device)
        _row_grads[(BH * triton.cdiv(L, cfg.C),)](
            dy, y, y_lo if y_lo is not None else y, den, dden, *_s3(dy), *_s3(y), L, H, cfg.Dv, eps, C=cfg.C,
            BV=cfg.BV, SPLIT=y_lo is not None, num_warps=4)
    else:
        den = dden = dy  # not read
    common = (*_s3(q), *_s3(k), *_s3(v), *_s3(dy))
    grad = (q, dy, dden, den)
    if total is not None:  # LION-LIT, bidirectional: the queries' total state beside the keys'
        G, gz = (x.sum(1) for x in _segment_states(cfg, False, None, pad, k, v, grad=grad, normalize=normalize,
                                                   eps=eps, entering=False))
        _global_apply[(BH * triton.cdiv(L, cfg.C),)](
            q, k, v, dy, y, y, den, dden, pad if pad is not None else dy, *total, G, gz, dq, dk, dv,
            *common, *_s3(y), *_s3(dq), *_s3(dk), *_s3(dv), *_pad_strides(pad), L, H, cfg.Dk, cfg.Dv, eps,
            GRAD=True, HAS_PAD=pad is not None, NORMALIZE=normalize, LO_OUT=False, SDT=cfg.SDT, **cfg.consts())
        return dq, dk, dv, None, None
    walks = {False: (f, b), True: (b, f)}  # reverse -> (the gates walked along, those walked against)
    sums = {}
    for reverse, (g_along, against) in walks.items():
        which_along, which_against = (4, 3) if reverse else (3, 4)  # the indices of their gates in needs
        has_along = not (reverse and causal)
        moments = has_along and _per_head(g_along) and needs[which_along]
        dcum_a = has_along and g_along is not None and not _per_head(g_along) and needs[which_along]
        dcum_b = against is not None and not _per_head(against) and needs[which_against]
        rca = torch.empty(BH, L, dtype=torch.float32, device=q.device) if dcum_a else None
        rcb = torch.empty(BH, L, dtype=torch.float32, device=q.device) if dcum_b else None
        mom = torch.empty(BH, cfg.nseg, dtype=torch.float32, device=q.device) if moments else None
        sums[reverse] = (rca, rcb, mom)
    common += (*_s3(dq), *_s3(dk), *_s3(dv))
    lo = {}  # the second halves of the pairs that the first of a gradient's two launches leaves
    for reverse, along, against in _backward_passes(causal, cfg.fused):
        g_along, g_against = walks[reverse]
        rca, rcb, mom = sums[reverse]
        first, last = not reverse or causal, reverse or causal  # of the two launches that write a gradient
        written = {"dq": dq} if along else {}
        if against:
            written.update(dk=dk, dv=dv)
        if cfg.SPLIT and not last:
            lo.update({name: torch.empty_like(x) for name, x in written.items()})
        along_states = []
        if along and cfg.nseg > 1:  # the forward's, unless a per-head gate's moments are wanted beside them
            along_states = (_forward_states(cfg, entering, reverse) if mom is None else None) or _segment_states(
                cfg, reverse, g_along, pad, k, v, moments=mom is not None)
        against_states = (_segment_states(cfg, reverse, g_against, pad, k, v, grad=grad, normalize=normalize,
                                          eps=eps) if against and cfg.nseg > 1 else [dy] * 2)
        states = along_states + [dy] * (4 - len(along_states)) + against_states
        _backward_walk[(BH, cfg.nseg)](
            q, k, v, dy, dden, den, g_along if g_along is not None else dy,
            g_against if g_against is not None else dy, pad if pad is not None else dy, *states, dq, dk, dv,
            *(lo.get(name, x) for name, x in (("dq", dq), ("dk", dk), ("dv", dv))),
            *(x if x is not None else dy for x in (rca, rcb, mom)),
            *common, *_s3(g_along), *_s3(g_against), *_pad_strides(pad), L, H, cfg.Dk, cfg.Dv, cfg.Q, eps,
            REVERSE=reverse, ALONG=along, AGAINST=against, GATE_A=along and g_along is not None,
            GATE_B=against and g_against is not None, HAS_PAD=pad is not None, S_IN=bool(along_states),
            M_IN=along and cfg.nseg > 1 and mom is not None, G_IN=against and cfg.nseg > 1,
            NORMALIZE=normalize, DCUM_A=along and rca is not None, DCUM_B=against and rcb is not None,
            MOMENTS=along and mom is not None, P_SUMS=along and (rca is not None or mom is not None),
            FIRST=first, LO_IN=cfg.SPLIT and not first, LO_OUT=cfg.SPLIT and not last, DT=cfg.DT,
            SDT=cfg.SDT, GDT=cfg.GDT, PREFETCH=PREFETCH[True], **cfg.consts())
        if last:  # this gradient's pair is summed: its second half is free for the next one's
            for name in written:
                lo.pop(name, None)
    df = _gate_grad(f, needs[3], sums[False][2], sums[False][0], sums[True][1], cfg, reverse=False)
    db = _gate_grad(b, needs[4], sums[True][2], sums[True][0], sums[False][1], cfg, reverse=True)
    return dq, dk, dv, df, db


def _gate_grad(g: Optional[Tensor], needed: bool, mom: Optional[Tensor], rows: Optional[Tensor],
               cols: Optional[Tensor], cfg: _Config, reverse: bool) -> Optional[Tensor]:
    """The gradient of a gate tensor ``(b, h, l)`` from the walks' sums: a per-head gate's moments, or
    a per-token gate's suffix sums (prefix sums for the backward direction, read in reverse) of the
    per-position row-minus-column sums of P."""
    if g is None or not needed:
        return None
    B, H, L = cfg.B, cfg.H, cfg.L
    if _per_head(g):
        full = mom.double().sum(1).view(B, H, 1)
    else:
        dcum = (rows.double() + cols.double()).view(B, H, L)
        if reverse:  # the gate at L-1 lies on no path
            full = dcum.cumsum(-1)
            full[..., -1] = 0
        else:  # the gate at 0 lies on no path
            full = dcum.flip(-1).cumsum(-1).flip(-1)
            full[..., 0] = 0
    dims = [i for i in range(3) if g.shape[i] == 1 and full.shape[i] > 1]
    return (full.sum(dims, keepdim=True) if dims else full).to(g.dtype)


def launching_on(x: Tensor) -> ContextManager:
    """Where a Triton launch runs: on the current CUDA device and its current stream, so on x's device
    here (x may sit on another GPU than the current one), in order with torch's work on it."""
    return torch.cuda.device(x.device) if x.is_cuda else nullcontext()


class _LionKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, f, b, pad, causal, normalize, eps, chunk_size, segment_chunks, keep):
        cfg = _Config(q, v, chunk_size, segment_chunks)
        with launching_on(q):
            y, y_lo, den, total, entering = _forward(cfg, q, k, v, f, b, pad, causal, normalize, eps, keep)
        ctx.save_for_backward(q, k, v, f, b, pad, y, y_lo, den, *(total or ()))
        ctx.causal, ctx.normalize, ctx.eps = causal, normalize, eps
        ctx.chunk_size, ctx.segment_chunks = chunk_size, segment_chunks
        ctx.has_total = total is not None
        # kept for the backward, whose walks along a per-head gate's direction sum them again with its
        # distance-weighted sums
        moments = any(_per_head(g) and ctx.needs_input_grad[i] for i, g in ((3, f), (4, b)))
        ctx.entering = entering if entering is not None and entering.states and not moments else None
        return y

    @staticmethod
    @first_derivatives_only("LION's Triton kernel (the chunk form)")
    def backward(ctx, dy):
        q, k, v, f, b, pad, y, y_lo, den, *total = ctx.saved_tensors
        dy = _addressable(dy)
        entering, ctx.entering = ctx.entering, None
        cfg = _backward_config(q, v, ctx.chunk_size, ctx.segment_chunks,
                               entering.tokens if entering is not None else None)
        try:
            with launching_on(q):
                dq, dk, dv, df, db = _backward(cfg, q, k, v, f, b, pad, y, y_lo, den,
                                               total if ctx.has_total else None, dy, ctx.causal, ctx.normalize,
                                               ctx.eps, ctx.needs_input_grad, entering)
        except OutOfResources as e:  # the backward's launches need more than the forward's
            from .backend import fall_back_from_triton
            from .fla import fla_available

            # said as later calls will fall back; these gradients come from the PyTorch chunk form
            fall_back_from_triton(v, does_not_fit(v, (q.shape[-1], v.shape[-1]), e), fla_available)
            dq, dk, dv, df, db = _torch_grads(ctx, q, k, v, f, b, pad, dy)
        return dq, dk, dv, df, db, None, None, None, None, None, None, None


def _torch_grads(ctx, q: Tensor, k: Tensor, v: Tensor, f: Optional[Tensor], b: Optional[Tensor],
                 pad: Optional[Tensor], dy: Tensor) -> List[Optional[Tensor]]:
    """The gradients of ``_LionKernel``'s inputs by the PyTorch chunk form (in float32), in their dtypes."""
    from .attention import lion_attention

    inputs = (q, k, v, f, b)
    with torch.enable_grad():
        leaves = [x.detach().float().requires_grad_(need) if x is not None else None
                  for x, need in zip(inputs, ctx.needs_input_grad[:5])]
        y = lion_attention(*leaves, form="chunk", backend="torch", causal=ctx.causal, normalize=ctx.normalize,
                           key_padding_mask=pad, eps=ctx.eps, chunk_size=ctx.chunk_size)
        wanted = [x for x in leaves if x is not None and x.requires_grad]
        found = iter(torch.autograd.grad(y, wanted, dy.float()) if wanted else ())
    return [next(found).to(x.dtype) if leaf is not None and leaf.requires_grad else None
            for x, leaf in zip(inputs, leaves)]


def kernel_unavailable(x: Tensor, head_dims: Tuple[int, int]) -> Optional[str]:
    """Why the kernel cannot run on ``x`` (with head sizes ``(Dk, Dv)``), or None."""
    if not (x.is_cuda or (INTERPRETED and x.device.type == "cpu")):
        return (f"it runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); got a {x.device.type} "
                "tensor")
    if x.dtype not in DTYPES:
        return f"it takes float32, bfloat16 or float16 inputs; got {x.dtype}"
    if max(head_dims) > MAX_HEAD_DIM:
        return f"it takes head sizes up to {MAX_HEAD_DIM}; got {head_dims}"
    return _DOES_NOT_FIT.get((str(x.device), x.dtype, tuple(head_dims)))


def does_not_fit(x: Tensor, head_dims: Tuple[int, int], error: OutOfResources) -> str:
    """Remember that the kernel's launches on x's device, dtype and head sizes ``(Dk, Dv)`` need more than
    the GPU has (``error``, raised as Triton loads a kernel, before it runs), and say so."""
    reason = (f"in {str(x.dtype).replace('torch.', '')} at head sizes {tuple(head_dims)} it needs {error.required} "
              f"of {error.name} per block, and this GPU has {error.limit}")
    _DOES_NOT_FIT[(str(x.device), x.dtype, tuple(head_dims))] = reason
    return reason


def cuts_into_segments(q: Tensor, v: Tensor, chunk_size: int = 64) -> bool:
    """Whether a call on q ``(B, H, L, Dk)`` and v cuts its walks into segments, whose sums are passes
    of their own: on a GPU, where B*H is at most about twice its streaming multiprocessors, and L more than
    one chunk."""
    return _Config(q, v, chunk_size, None).nseg > 1


@eager_under_compile
def kernel_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor], log_a_bwd: Optional[Tensor],
                     causal: bool, normalize: bool, key_padding_mask: Optional[Tensor], eps: float,
                     chunk_size: int = 64, segment_chunks: Optional[int] = None) -> Tensor:
    """``lion_attention``'s operator in the fused kernel. q, k ``(B, H, L, Dk)``, v ``(B, H, L, Dv)``, any
    strides, one dtype of ``DTYPES``; log-gates float32 ``(b, h, l)`` with b in {1, B}, h in {1, H}, l in
    {1, L} (l = 1: one gate per head) or None; ``key_padding_mask`` ``(B, L)`` bool. Returns
    ``(B, H, L, Dv)`` in v's dtype; differentiable in q, k, v and the gates. ``chunk_size`` is rounded to a
    power of two of at least 16 and capped by ``BLOCKS``; ``segment_chunks``: chunks per segment (default: enough segments to fill
    the GPU)."""
    if not q.dtype == k.dtype == v.dtype or v.dtype not in DTYPES:
        raise ValueError(f"kernel_attention takes q, k and v of one dtype of {DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    q, k, v = (_addressable(x) for x in (q, k, v))
    pad = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
    if causal:
        log_a_bwd = None
    # whether a backward will read y (only when normalised); inside forward, ctx.needs_input_grad says yes
    # under torch.no_grad too
    keep = normalize and needs_grad(q, k, v, log_a_fwd, log_a_bwd)
    return _LionKernel.apply(q, k, v, log_a_fwd, log_a_bwd, pad, causal, normalize, eps, chunk_size,
                             segment_chunks, keep)
