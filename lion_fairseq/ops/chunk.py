"""The chunkwise form: exact attention inside chunks of C tokens, ``Dk x Dv`` states carried between them.
O(L*C*D + L*D^2) time, O(L*D) memory: no L x L tensor.

Both directions share one masked product inside a chunk, ``A = (q k^T) * W`` with ``W = W_fwd + W_bwd^T``
(``W_fwd`` the lower triangle, diagonal included, of the forward decays, ``W_bwd`` the strict lower
triangle of the backward decays on shifted gates). Between chunks each direction has a state per chunk:
the chunks' own contributions ``U_m = (k_m * own)^T v_m`` are batched matmuls, a scan over the chunk axis
turns them into the state entering each chunk, and the two directions are read with one matmul:
``[q * read_f | q * read_b] @ [E_f ; E_b]``. The normaliser has its own ``Dk`` vector states.

The data is laid out chunk first, ``(N, G, C, D)`` with ``G = B*H``, so that a block of chunks of
every head is one contiguous batch for ``bmm``: speed on a CPU comes from those matmuls and from
touching each ``C x C`` matrix as few times as possible. The backward pass is written out and reuses
the forward's ``A``, ``W`` and states rather than recomputing them."""
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# Tokens per block of chunks, all heads counted: the block's C x C matrices (4 * BLOCK_TOKENS * C bytes
# each) stay in the CPU's cache between the ops that touch them.
BLOCK_TOKENS = 4096


class Decay(NamedTuple):
    """One direction's decays on the chunk grid for ``M_ij = exp(c_i - c_j)`` (i >= j), with ``c`` the
    within-chunk inclusive cumulative log-gate (float64, so ``c_i - c_j`` is exact near the diagonal);
    every exponent is a partial sum of log-gates, so <= 0."""
    cum: Tensor         # (N, G, C) float64 c
    from_start: Tensor  # (N, G, C) exp(c_i): decay from the chunk's start to i
    to_end: Tensor      # (N, G, C) exp(c_last - c_j): decay from j to the chunk's end
    whole: Tensor       # (N, G) exp(c_last): decay across the chunk


def make_decay(log_a: Optional[Tensor], N: int, C: int, dtype: torch.dtype) -> Optional[Decay]:
    """log_a: ``(G, N*C)`` or None (gates 1, no decay)."""
    if log_a is None:
        return None
    c = log_a.view(log_a.shape[0], N, C).transpose(0, 1).double().cumsum(-1)
    return Decay(c, c.to(dtype).exp(), (c[..., -1:] - c).to(dtype).exp(), c[..., -1].to(dtype).exp())


# Tokens per sub-block of a chunk's decay matrix: the diagonal sub-blocks take exact differences
# (C * SUB exps), the rest a rank-1 product per row (forward) or column (backward) sub-block.
SUB = 16


def _factors(c: Tensor, S: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """c ``(b, P*S)`` float64, non-increasing. For row i in sub-block p and a column j before it,
    ``exp(c_i - c_j) = rows[p, i] * cols[p, j]`` with the anchor ``a_p`` the cumulative log-gate just
    before sub-block p: ``rows = exp(c_i - a_p)``, ``cols = exp(a_p - c_j)`` (0 from sub-block p on).
    Both are decays; each exponent is taken in float64 and rounded once. Returns rows ``(b, P, S)``,
    cols ``(b, P, P*S)``, and c as sub-blocks ``(b, P, S)``."""
    b, PS = c.shape
    P = PS // S
    blocks = c.view(b, P, S)
    anchor = F.pad(blocks[..., :-1, -1], (1, 0))  # (b, P): c before each sub-block (0 before the chunk)
    before = torch.arange(PS, device=c.device)[None, :] < (torch.arange(P, device=c.device) * S)[:, None]
    cols = (anchor[..., :, None] - c[..., None, :]).to(dtype).masked_fill_(~before, float("-inf")).exp_()
    return (blocks - anchor[..., None]).to(dtype).exp_(), cols, blocks


def decay_matrix(cf: Optional[Tensor], cb: Optional[Tensor], bidirectional: bool, b: int, C: int,
                 dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
    """``W = W_fwd + W_bwd^T`` ``(b, C, C)`` of b chunks from their cumulative log-gates ``cf``, ``cb``
    ``(b, C)`` float64 (None: gates 1), or None when W is all ones (no decay either way).

    ``W_ij = exp(cf_i - cf_j)`` for i >= j and ``exp(cb_j - cb_i)`` for i < j (0 when causal). Every
    exponent is <= 0 whatever the gates, and is a difference taken in float64 (so exact near the
    diagonal, where c_i - c_j is small beside c); nothing is decided on the host."""
    if cf is None and cb is None:
        if bidirectional:
            return None
        return torch.ones(C, C, dtype=dtype, device=device).tril().expand(b, C, C)
    S = min(SUB, C)
    P = -(-C // S)

    def padded(c: Optional[Tensor]) -> Tensor:  # gates 1 past the chunk's end: cropped below
        if c is None:
            return torch.zeros(b, P * S, dtype=torch.float64, device=device)
        return torch.cat([c, c[:, -1:].expand(b, P * S - C)], dim=1) if P * S > C else c

    lower = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    rows, cols, blocks = _factors(padded(cf), S, dtype)
    W = (rows[..., None] * cols[..., None, :]).view(b, P * S, P * S)
    diag = (blocks[..., :, None] - blocks[..., None, :]).to(dtype).masked_fill_(~lower, float("-inf")).exp_()
    if bidirectional:  # column j in sub-block p, row i before it: W_ij = rows_b[p, j] * cols_b[p, i]
        rows, cols, blocks = _factors(padded(cb), S, dtype)
        W.view(b, P * S, P, S).addcmul_(cols.transpose(-1, -2)[..., None], rows[:, None])
        diag += (blocks[..., None, :] - blocks[..., :, None]).to(dtype).masked_fill_(lower, float("-inf")).exp_()
    W.view(b, P, S, P, S).diagonal(dim1=1, dim2=3).copy_(diag.movedim(1, -1))
    return W[:, :C, :C].contiguous() if P * S > C else W


def scan_(xs: List[Tensor], whole: Optional[Tensor], reverse: bool) -> None:
    """In place, over the chunk axis of each x ``(N, G, ...)``: ``x[m] <- sum_{j<m} (prod_{j<l<m}
    whole[l]) x[j]`` (``j > m`` and ``m<l<j`` when ``reverse``); whole ``(N, G)`` or None (1).

    The chunks' own contributions become the states entering each chunk. Its adjoint is the same scan
    the other way round, which is how the backward pass carries gradients between chunks. One fused op
    per chunk and tensor, on every head at once."""
    for x in xs:
        state = torch.zeros_like(x[0])
        nxt = torch.empty_like(state)
        w = whole.view(whole.shape + (1,) * (x.dim() - 2)) if whole is not None else None
        for m in (range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])):
            if w is None:
                torch.add(x[m], state, out=nxt)
            else:
                torch.addcmul(x[m], state, w[m], out=nxt)
            x[m].copy_(state)
            state, nxt = nxt, state


class _Grid(NamedTuple):
    """What the forward and backward passes share: each direction's decays and the blocks of chunks."""
    fwd: Optional[Decay]
    bwd: Optional[Decay]
    bidirectional: bool
    combined: bool  # bidirectional without decay: one state, of every chunk but the own one
    blocks: List[Tuple[int, int]]

    def dirs(self) -> int:
        return 2 if self.bidirectional and not self.combined else 1

    def scales(self, which: str, s: slice) -> List[Optional[Tensor]]:
        """Per direction, the ``(n, G, C)`` scale of q (``read``) or of k (``own``) for the states."""
        out = []
        for d, read, own in ((self.fwd, "from_start", "to_end"), (self.bwd, "to_end", "from_start"))[:self.dirs()]:
            out.append(getattr(d, read if which == "read" else own)[s] if d is not None else None)
        return out

    def stacked(self, x: Tensor, which: str, s: slice) -> Tensor:
        """``[x * scale_f | x * scale_b]`` ``(n, G, C, dirs * D)`` of x ``(n, G, C, D)``."""
        scales = self.scales(which, s)
        if len(scales) == 1 and scales[0] is None:
            return x
        D = x.shape[-1]
        out = x.new_empty(x.shape[:-1] + (len(scales) * D,))
        for i, sc in enumerate(scales):
            if sc is None:
                out[..., i * D:(i + 1) * D] = x
            else:
                torch.mul(x, sc[..., None], out=out[..., i * D:(i + 1) * D])
        return out

    def add_scaled(self, dst: Tensor, x: Tensor, which: str, s: slice) -> None:
        """``dst += sum_dir scale_dir * x[..., dir]`` for x ``(n, G, C, dirs * D)``."""
        D = dst.shape[-1]
        for i, sc in enumerate(self.scales(which, s)):
            part = x[..., i * D:(i + 1) * D]
            dst.add_(part) if sc is None else dst.addcmul_(part, sc[..., None])

    def matrix(self, s: slice, n: int, G: int, C: int, dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
        """``W`` of the chunks ``s``, ``(n * G, C, C)``, or None (all ones)."""
        cf = self.fwd.cum[s].reshape(n * G, C) if self.fwd is not None else None
        cb = self.bwd.cum[s].reshape(n * G, C) if self.bwd is not None else None
        return decay_matrix(cf, cb, self.bidirectional, n * G, C, dtype, device)

    def states_(self, xs: List[Tensor], adjoint: bool = False) -> None:
        """The chunks' contributions ``(N, G, dirs*Dk, ...)`` -> the states entering each chunk, in place;
        ``adjoint``: gradients w.r.t. the entering states -> w.r.t. the contributions (each scan run the
        other way round)."""
        if self.combined:  # every chunk but the own one, total - own: its own adjoint
            for x in xs:
                total = x.sum(0)
                x.neg_().add_(total)
            return
        Dk = xs[0].shape[2] // self.dirs()
        scan_([x[:, :, :Dk] for x in xs], self.fwd.whole if self.fwd is not None else None, reverse=adjoint)
        if self.dirs() == 2:
            scan_([x[:, :, Dk:] for x in xs], self.bwd.whole if self.bwd is not None else None, reverse=not adjoint)


def _grid(log_f: Optional[Tensor], log_b: Optional[Tensor], G: int, N: int, C: int, bidirectional: bool,
          dtype: torch.dtype) -> _Grid:
    per = max(1, BLOCK_TOKENS // (C * G))
    fwd, bwd = make_decay(log_f, N, C, dtype), make_decay(log_b, N, C, dtype) if bidirectional else None
    return _Grid(fwd, bwd, bidirectional, bidirectional and fwd is None and bwd is None,
                 [(n0, min(n0 + per, N)) for n0 in range(0, N, per)])


def _flat(x: Tensor) -> Tensor:
    """``(n, G, C, D)`` -> ``(n * G, C, D)``, the batch of the matmuls."""
    return x.view(-1, *x.shape[2:])


def _bmm_into(dst: Tensor, a: Tensor, b: Tensor, add: bool = False) -> None:
    """``dst = a @ b`` (``dst += a @ b`` when ``add``), batched. With bfloat16 operands the product runs
    in bfloat16 (float32 accumulation inside the kernel) and is added to the float32 ``dst``; b is
    rounded to a's dtype first (a state read by bfloat16 queries)."""
    if a.dtype == dst.dtype:
        dst.baddbmm_(a, b) if add else torch.bmm(a, b, out=dst)
        return
    out = torch.bmm(a, b.to(a.dtype))
    dst.add_(out) if add else dst.copy_(out)


class _ChunkAttention(torch.autograd.Function):
    """``o = ((q k^T) * W) v`` on the chunk grid, divided by ``((q k^T) * W) 1 + eps`` when normalising:
    q, k ``(N, G, C, Dk)``, v ``(N, G, C, Dv)``, contiguous, chunk first (padded to N*C tokens);
    log-gates ``(G, N*C)`` or None. The normaliser's states are ``(dirs*Dk,)`` vectors beside the
    ``(dirs*Dk, Dv)`` ones, so that every matmul is as wide as v (a column of ones in v would make them
    Dv + 1 wide, which the GEMM kernels run markedly slower). Training keeps each block's ``A`` and ``W``
    and the states for the backward pass (O(L*C + L*D) per head); inference, one block at a time."""

    @staticmethod
    def forward(ctx, q, k, v, log_f, log_b, bidirectional, normalize, eps):
        N, G, C, Dk = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # outputs, states, decays, normalisers
        grid = _grid(log_f, log_b, G, N, C, bidirectional, acc)
        train = any(ctx.needs_input_grad[:5])
        if train and q.dtype != acc:
            raise ValueError(f"the chunk form trains in float32; got {q.dtype} inputs that need gradients")
        saved = []
        y = q.new_empty(v.shape, dtype=acc)
        E = q.new_empty(N, G, grid.dirs() * Dk, v.shape[-1], dtype=acc)
        Z = q.new_empty(N, G, grid.dirs() * Dk, dtype=acc) if normalize else None
        den = q.new_empty(N, G, C, dtype=acc) if normalize else None
        for n0, n1 in grid.blocks:  # within chunks, and each chunk's own contribution to the states
            s = slice(n0, n1)
            qs, ks, vs = _flat(q[s]), _flat(k[s]), _flat(v[s])
            A = torch.bmm(qs, ks.transpose(1, 2))
            W = grid.matrix(s, n1 - n0, G, C, acc, q.device)
            if W is not None:  # bfloat16 scores times float32 decays, rounded once, in place
                A.mul_(W)
            _bmm_into(_flat(y[s]), A, vs)
            own = grid.stacked(k[s], "own", s)
            _bmm_into(_flat(E[s]), _flat(own).transpose(1, 2), vs)
            if normalize:
                torch.sum(A.view(n1 - n0, G, C, C), -1, dtype=acc, out=den[s])
                torch.sum(own, -2, dtype=acc, out=Z[s])
            if train:
                saved.append((A, W))
        grid.states_([E, Z] if normalize else [E])
        for n0, n1 in grid.blocks:  # both directions' states, read with one matmul
            s = slice(n0, n1)
            read = _flat(grid.stacked(q[s], "read", s))
            _bmm_into(_flat(y[s]), read, _flat(E[s]), add=True)
            if normalize:
                _flat(den[s]).unsqueeze(-1).baddbmm_(read.to(acc), _flat(Z[s]).unsqueeze(-1))
                y[s] /= den[s, ..., None] + eps
        if train:
            ctx.save_for_backward(q, k, v, log_f, log_b, y, den, E, Z)
            ctx.blocks_saved = saved
        ctx.bidirectional, ctx.normalize, ctx.eps = bidirectional, normalize, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, log_f, log_b, y, den, E, Z = ctx.saved_tensors
        saved = ctx.blocks_saved
        normalize, eps = ctx.normalize, ctx.eps
        N, G, C, Dk = q.shape
        grid = _grid(log_f, log_b, G, N, C, ctx.bidirectional, q.dtype)
        fwd, bwd = grid.fwd, grid.bwd
        dy = dy.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if normalize:  # the gradients w.r.t. the unnormalised output and the normaliser
            inv = 1.0 / (den + eps)
            do = dy * inv[..., None]
            dden = (dy * y).sum(-1).mul_(inv).neg_()
        else:
            do, dden = dy, None
        dE = torch.empty_like(E)
        dZ = torch.empty_like(Z) if normalize else None
        # d loss / d (cumulative log-gate at t) = what t gains as a query minus what it gives as a key,
        # P_ij = M_ij (q_i . k_j)(do_i . v_j + dden_i); log_a_u enters every cumulative sum from u on.
        dcum_f = q.new_zeros(N, G, C) if fwd is not None else None
        dcum_b = q.new_zeros(N, G, C) if bwd is not None else None
        for (n0, n1), (A, W) in zip(grid.blocks, saved):
            s = slice(n0, n1)
            n = n1 - n0
            qs, ks, vs, dos = _flat(q[s]), _flat(k[s]), _flat(v[s]), _flat(do[s])
            dA = torch.bmm(dos, vs.transpose(1, 2))
            if normalize:
                dA += _flat(dden[s])[..., None]
            torch.bmm(A.transpose(1, 2), dos, out=_flat(dv[s]))
            if fwd is not None or bwd is not None:
                X = (A * dA).view(n, G, C, C)  # P_ij inside the chunk
                rows, cols = X.sum(-1), X.sum(-2)
                if grid.bidirectional:
                    X.tril_()
                    rows_f, cols_f = X.sum(-1), X.sum(-2)
                else:
                    rows_f, cols_f = rows, cols
                if fwd is not None:
                    dcum_f[s] += rows_f - cols_f
                if bwd is not None:
                    dcum_b[s] += (cols - cols_f) - (rows - rows_f)
            if W is not None:
                dA.mul_(W)
            torch.bmm(dA, ks, out=_flat(dq[s]))
            torch.bmm(dA.transpose(1, 2), qs, out=_flat(dk[s]))
            read = grid.stacked(q[s], "read", s)
            torch.bmm(_flat(read).transpose(1, 2), dos, out=_flat(dE[s]))
            dread = torch.bmm(dos, _flat(E[s]).transpose(1, 2)).view(read.shape)
            if normalize:
                dread.addcmul_(dden[s, ..., None], Z[s, :, None, :])
                torch.bmm(_flat(read).transpose(1, 2), _flat(dden[s])[..., None], out=_flat(dZ[s])[..., None])
            grid.add_scaled(dq[s], dread, "read", s)
            if dcum_f is not None or dcum_b is not None:
                gain = (read * dread).view(n, G, C, -1, Dk).sum(-1)
                if dcum_f is not None:
                    dcum_f[s] += gain[..., 0]
                if dcum_b is not None:
                    dcum_b[s] -= gain[..., 1]
        grid.states_([dE, dZ] if normalize else [dE], adjoint=True)
        for n0, n1 in grid.blocks:
            s = slice(n0, n1)
            own = grid.stacked(k[s], "own", s)
            down = torch.bmm(_flat(v[s]), _flat(dE[s]).transpose(1, 2)).view(own.shape)
            if normalize:
                down += dZ[s, :, None, :]
            _flat(dv[s]).baddbmm_(_flat(own), _flat(dE[s]))
            grid.add_scaled(dk[s], down, "own", s)
            if dcum_f is not None or dcum_b is not None:
                give = (own * down).view(n1 - n0, G, C, -1, Dk).sum(-1)
                if dcum_f is not None:
                    dcum_f[s] -= give[..., 0]
                if dcum_b is not None:
                    dcum_b[s] += give[..., 1]
        dlog_f = _suffix_sum(dcum_f) if dcum_f is not None and ctx.needs_input_grad[3] else None
        dlog_b = _suffix_sum(dcum_b) if dcum_b is not None and ctx.needs_input_grad[4] else None
        return dq, dk, dv, dlog_f, dlog_b, None, None, None


def _suffix_sum(dcum: Tensor) -> Tensor:
    """``(N, G, C)`` per-position gradients of cumulative sums -> ``(G, N*C)`` gradients of the
    log-gates; position 0's gate lies on no path."""
    flat = dcum.transpose(0, 1).reshape(dcum.shape[1], -1).double()
    out = flat.flip(-1).cumsum(-1).flip(-1)
    out[..., 0] = 0.0
    return out.to(dcum.dtype)


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor],
                    log_a_bwd: Optional[Tensor], causal: bool, chunk_size: int, normalize: bool = False,
                    eps: float = 1e-6) -> Tensor:
    """q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)``; gates ``(B, H, L)`` or None. Returns ``(B, H, L, Dv)``:
    ``((q k^T) * M) v``, divided row by row by ``sum_j (q k^T * M)_ij + eps`` if ``normalize``.

    q, k, v in float32 (or float64), or in bfloat16 for inference: the matmuls then run in bfloat16 and
    the output, the states, the decays and the normaliser stay float32 (the result is float32)."""
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, L)
    N = -(-L // C)
    pad = N * C - L
    # The backward direction as a forward-style decay on gates shifted by one:
    # b_i ... b_{j-1} = a'_{i+1} ... a'_j with a'_u = b_{u-1}.
    log_b = F.pad(log_a_bwd[..., :-1], (1, 0)) if (log_a_bwd is not None and not causal) else None
    log_f = log_a_fwd
    if pad:  # zero tokens and gates of 1 at the end: they contribute nothing in either direction
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        log_f = F.pad(log_f, (0, pad)) if log_f is not None else None
        log_b = F.pad(log_b, (0, pad)) if log_b is not None else None
    G = B * H

    def chunk_first(x: Tensor) -> Tensor:  # (B, H, N*C, D) -> (N, B*H, C, D), one copy
        return x.reshape(G, N, C, x.shape[-1]).transpose(0, 1).contiguous()

    gates = [x.reshape(G, N * C) if x is not None else None for x in (log_f, log_b)]
    y = _ChunkAttention.apply(chunk_first(q), chunk_first(k), chunk_first(v), *gates, not causal, normalize, eps)
    y = y.view(N, B, H, C, Dv).permute(1, 2, 0, 3, 4).reshape(B, H, N * C, Dv)
    return y[:, :, :L] if pad else y
