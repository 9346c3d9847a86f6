"""The chunkwise form: exact attention inside chunks of C tokens, ``Dk x Dv`` states carried between them.
O(L*C*D + L*D^2) time, O(L*D) memory: no L x L tensor.

Both directions share one masked product inside a chunk, ``A = (q k^T) * W`` with ``W = W_fwd + W_bwd^T``
(``W_fwd`` the lower triangle, diagonal included, of the forward decays, ``W_bwd`` the strict lower
triangle of the backward decays on shifted gates). Between chunks each direction has a state per chunk:
the chunks' own contributions ``U_m = (k_m * own)^T v_m`` are batched matmuls, a scan over the chunk axis
turns them into the state entering each chunk, and the two directions are read with one matmul:
``[q * read_f | q * read_b] @ [E_f ; E_b]``. The normaliser has its own ``Dk`` vector states.

The data keeps the caller's layout, ``(B, H, L, D)`` seen as ``(G*N, C, D)`` chunks (``G = B*H`` heads of
N chunks each, head-major), so that no copy of q, k, v, the output or the gradients changes their layout,
and any run of consecutive chunks is one contiguous batch for ``bmm``. Speed on a CPU comes from those
matmuls, from touching each ``C x C`` matrix as few times as possible, and from not allocating afresh:
temporaries and what the backward pass keeps live in reused buffers (``workspace.py``). The backward
pass is written out and reuses the forward's ``A``, ``W`` and states rather than recomputing them."""
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .compiling import eager_under_compile
from .first_derivatives import first_derivatives_only
from .float32 import accumulation_dtype
from .workspace import workspace

# Tokens per block of chunks. On a CPU, the block's C x C matrices (4 * BLOCK_TOKENS * C bytes each) stay in
# its cache between the ops that touch them. On a GPU each op of a block is a kernel launch, and blocks of
# 4096 tokens left the form launch-bound (an H200 took 87-175 ms for a forward of 32768 tokens x 12 heads,
# thousands of launches: about 6000 ops that are not views at B = 8, L = 4096), so a block there is as large
# as its C x C temporaries allow (64 MiB each at C = 64).
BLOCK_TOKENS = 4096
BLOCK_TOKENS_GPU = 1 << 18


class Decay(NamedTuple):
    """One direction's decays on the chunk grid for ``M_ij = exp(c_i - c_j)`` (i >= j), with ``c`` the
    within-chunk inclusive cumulative log-gate (float64, so ``c_i - c_j`` is exact near the diagonal);
    every exponent is a partial sum of log-gates, so <= 0. Chunks are head-major, ``G*N`` of them."""
    cum: Tensor         # (G*N, C) float64 c
    from_start: Tensor  # (G*N, C) exp(c_i): decay from the chunk's start to i
    to_end: Tensor      # (G*N, C) exp(c_last - c_j): decay from j to the chunk's end
    whole: Tensor       # (G, N) exp(c_last): decay across the chunk


def make_decay(log_a: Optional[Tensor], C: int, dtype: torch.dtype) -> Optional[Decay]:
    """log_a: ``(G, N*C)`` or None (gates 1, no decay)."""
    if log_a is None:
        return None
    G = log_a.shape[0]
    c = log_a.reshape(-1, C).double().cumsum(-1)
    return Decay(c, c.to(dtype).exp(), (c[:, -1:] - c).to(dtype).exp(), c[:, -1].to(dtype).exp().view(G, -1))


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
                 dtype: torch.dtype, device: torch.device, out: Optional[Tensor] = None) -> Optional[Tensor]:
    """``W = W_fwd + W_bwd^T`` ``(b, C, C)`` of b chunks from their cumulative log-gates ``cf``, ``cb``
    ``(b, C)`` float64 (None: gates 1), or None when W is all ones (no decay either way).

    ``W_ij = exp(cf_i - cf_j)`` for i >= j and ``exp(cb_j - cb_i)`` for i < j (0 when causal). Every
    exponent is <= 0 whatever the gates, and is a difference taken in float64 (so exact near the
    diagonal, where c_i - c_j is small beside c); nothing is decided on the host. ``out``: a ``(b, C, C)``
    buffer to write W into (used when C is a multiple of the sub-block)."""
    if cf is None and cb is None:
        if bidirectional:
            return None
        tril = torch.ones(C, C, dtype=dtype, device=device).tril().expand(b, C, C)
        return out.copy_(tril) if out is not None else tril
    S = min(SUB, C)
    P = -(-C // S)

    def padded(c: Optional[Tensor]) -> Tensor:  # gates 1 past the chunk's end: cropped below
        if c is None:
            return torch.zeros(b, P * S, dtype=torch.float64, device=device)
        return torch.cat([c, c[:, -1:].expand(b, P * S - C)], dim=1) if P * S > C else c

    lower = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    rows, cols, blocks = _factors(padded(cf), S, dtype)
    if out is not None and P * S == C:
        W = torch.mul(rows[..., None], cols[..., None, :], out=out.view(b, P, S, P * S)).view(b, C, C)
    else:
        W = (rows[..., None] * cols[..., None, :]).view(b, P * S, P * S)
    diag = (blocks[..., :, None] - blocks[..., None, :]).to(dtype).masked_fill_(~lower, float("-inf")).exp_()
    if bidirectional:  # column j in sub-block p, row i before it: W_ij = rows_b[p, j] * cols_b[p, i]
        rows, cols, blocks = _factors(padded(cb), S, dtype)
        W.view(b, P * S, P, S).addcmul_(cols.transpose(-1, -2)[..., None], rows[:, None])
        diag += (blocks[..., None, :] - blocks[..., :, None]).to(dtype).masked_fill_(lower, float("-inf")).exp_()
    W.view(b, P, S, P, S).diagonal(dim1=1, dim2=3).copy_(diag.movedim(1, -1))
    if P * S > C:  # cropped: into out when there is one
        return out.copy_(W[:, :C, :C]) if out is not None else W[:, :C, :C].contiguous()
    return W


def scan(u: Tensor, out: Tensor, whole: Optional[Tensor], reverse: bool) -> None:
    """Over the chunk axis (dim 1) of u ``(G, N, ...)``: ``out[:, m] = sum_{j<m} (prod_{j<l<m} whole[:, l])
    u[:, j]`` (``j > m`` and ``m<l<j`` when ``reverse``); whole ``(G, N)`` or None (1). ``out`` may be u.

    The chunks' own contributions u become the states entering each chunk: ``out[:, m+1] = whole[:, m] *
    out[:, m] + u[:, m]``, one fused op per chunk on every head at once (two in place, where a chunk's
    contribution is read before its state overwrites it). Its adjoint is the same scan the other way
    round, which is how the backward pass carries gradients between chunks."""
    N = u.shape[1]
    us, outs = u.unbind(1), out.unbind(1)  # the per-chunk views made at once, not one by one in the loop
    ws = whole.view(whole.shape + (1,) * (u.dim() - 2)).unbind(1) if whole is not None else None
    order = range(N - 1, -1, -1) if reverse else range(N)

    def step(m: int, state: Tensor, dst: Tensor) -> None:  # dst = whole[m] * state + u[m]
        if ws is None:
            torch.add(us[m], state, out=dst)
        else:
            torch.addcmul(us[m], state, ws[m], out=dst)

    if out.data_ptr() == u.data_ptr():
        state, nxt = torch.zeros_like(us[0]), torch.empty_like(us[0])
        for m in order:
            step(m, state, nxt)
            us[m].copy_(state)
            state, nxt = nxt, state
        return
    outs[order[0]].zero_()
    for m, after in zip(order, order[1:]):
        step(m, outs[m], outs[after])


class _Grid(NamedTuple):
    """What the forward and backward passes share: each direction's decays and the blocks of chunks."""
    fwd: Optional[Decay]
    bwd: Optional[Decay]
    bidirectional: bool
    combined: bool  # bidirectional without decay: one state, of every chunk but the own one
    G: int
    N: int
    blocks: List[slice]

    def dirs(self) -> int:
        return 2 if self.bidirectional and not self.combined else 1

    def scales(self, which: str, s: slice) -> List[Optional[Tensor]]:
        """Per direction, the ``(n, C)`` scale of q (``read``) or of k (``own``) for the states."""
        out = []
        for d, read, own in ((self.fwd, "from_start", "to_end"), (self.bwd, "to_end", "from_start"))[:self.dirs()]:
            out.append(getattr(d, read if which == "read" else own)[s] if d is not None else None)
        return out

    def stacked(self, x: Tensor, which: str, s: slice) -> Tensor:
        """``[x * scale_f | x * scale_b]`` ``(n, C, dirs * D)`` of x ``(n, C, D)``, in a workspace buffer."""
        scales = self.scales(which, s)
        if len(scales) == 1 and scales[0] is None:
            return x
        D = x.shape[-1]
        out = workspace(which, x.shape[:-1] + (len(scales) * D,), x.dtype, x.device)
        for i, sc in enumerate(scales):
            if sc is None:
                out[..., i * D:(i + 1) * D] = x
            else:
                torch.mul(x, sc[..., None].to(x.dtype), out=out[..., i * D:(i + 1) * D])
        return out

    def add_scaled(self, dst: Tensor, x: Tensor, which: str, s: slice) -> None:
        """``dst += sum_dir scale_dir * x[..., dir]`` for x ``(n, C, dirs * D)``."""
        D = dst.shape[-1]
        for i, sc in enumerate(self.scales(which, s)):
            part = x[..., i * D:(i + 1) * D]
            dst.add_(part) if sc is None else dst.addcmul_(part, sc[..., None])

    def matrix(self, s: slice, n: int, C: int, dtype: torch.dtype, device: torch.device,
               out: Optional[Tensor] = None) -> Optional[Tensor]:
        """``W`` of the chunks ``s``, ``(n, C, C)``, or None (all ones)."""
        cf = self.fwd.cum[s] if self.fwd is not None else None
        cb = self.bwd.cum[s] if self.bwd is not None else None
        return decay_matrix(cf, cb, self.bidirectional, n, C, dtype, device, out)

    def states(self, us: List[Tensor], outs: List[Tensor], adjoint: bool = False) -> None:
        """The chunks' contributions ``(G*N, dirs*Dk, ...)`` -> the states entering each chunk, into outs;
        ``adjoint``: gradients w.r.t. the entering states -> w.r.t. the contributions (each scan run the
        other way round)."""
        for u, out in zip(us, outs):
            u, out = u.view(self.G, self.N, *u.shape[1:]), out.view(self.G, self.N, *out.shape[1:])
            if self.combined:  # every chunk but the own one, total - own: its own adjoint
                torch.sub(u.sum(1, keepdim=True), u, out=out)
                continue
            Dk = u.shape[2] // self.dirs()
            scan(u[:, :, :Dk], out[:, :, :Dk], self.fwd.whole if self.fwd is not None else None, reverse=adjoint)
            if self.dirs() == 2:
                scan(u[:, :, Dk:], out[:, :, Dk:], self.bwd.whole if self.bwd is not None else None,
                     reverse=not adjoint)


def _grid(log_f: Optional[Tensor], log_b: Optional[Tensor], G: int, N: int, C: int, bidirectional: bool,
          dtype: torch.dtype, device: torch.device) -> _Grid:
    """Gates ``(G, N*C)``, or ``(G, 1)``: one per head."""
    per = max(1, (BLOCK_TOKENS if device.type == "cpu" else BLOCK_TOKENS_GPU) // C)
    log_f, log_b = (g.expand(G, N * C) if g is not None else None for g in (log_f, log_b))
    fwd, bwd = make_decay(log_f, C, dtype), make_decay(log_b, C, dtype) if bidirectional else None
    return _Grid(fwd, bwd, bidirectional, bidirectional and fwd is None and bwd is None, G, N,
                 [slice(i, min(i + per, G * N)) for i in range(0, G * N, per)])


def _low(name: str, x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in ``dtype``, rounded into a workspace buffer (no copy when it is already): elementwise ops on
    mixed float32 and bfloat16 operands run several times slower on a CPU than a conversion and the op."""
    return x if x.dtype == dtype else workspace(name, x.shape, dtype, x.device).copy_(x)


def _bmm_into(dst: Tensor, a: Tensor, b: Tensor, add: bool = False) -> None:
    """``dst = a @ b`` (``dst += a @ b`` when ``add``), batched. With bfloat16 operands the product runs
    in bfloat16 (float32 accumulation inside the kernel), is rounded once and lands in the float32
    ``dst``; b is rounded to a's dtype first (a float32 state read by bfloat16 queries)."""
    if a.dtype == dst.dtype:
        dst.baddbmm_(a, b) if add else torch.bmm(a, b, out=dst)
        return
    out = torch.bmm(a, _low("b", b, a.dtype), out=workspace("ab", dst.shape, a.dtype, a.device))
    dst.add_(_low("ab32", out, dst.dtype)) if add else dst.copy_(out)


def _sum_into(dst: Tensor, x: Tensor, dim: int) -> None:
    """``dst = x.sum(dim)``; a bfloat16 x is summed with float32 accumulation inside the kernel and rounded
    once (asking for a float32 result converts x first, which costs several times the sum)."""
    if x.dtype == dst.dtype:
        torch.sum(x, dim, out=dst)
    else:
        dst.copy_(x.sum(dim))


class _ChunkAttention(torch.autograd.Function):
    """``o = ((q k^T) * W) v`` on the chunk grid, divided by ``((q k^T) * W) 1 + eps`` when normalising:
    q, k ``(G*N, C, Dk)``, v ``(G*N, C, Dv)``, contiguous, head-major chunks (padded to N*C tokens);
    log-gates ``(G, N*C)``, ``(G, 1)`` (one per head) or None. The normaliser's states are ``(dirs*Dk,)`` vectors beside the
    ``(dirs*Dk, Dv)`` ones, so that every matmul is as wide as v (a column of ones in v would make them
    Dv + 1 wide, which the GEMM kernels run markedly slower). Training keeps every chunk's ``A`` and ``W``
    and the states for the backward pass (O(L*C + L*D) per head); inference, one block at a time."""

    @staticmethod
    def forward(ctx, q, k, v, log_f, log_b, N, bidirectional, normalize, eps):
        M, C, Dk = q.shape
        G = M // N
        acc = accumulation_dtype(q)  # outputs, states, decays, normalisers
        grid = _grid(log_f, log_b, G, N, C, bidirectional, acc, q.device)
        train = any(ctx.needs_input_grad[:5])
        if train and q.dtype != acc:
            raise ValueError(f"the chunk form trains in float32; got {q.dtype} inputs that need gradients")

        def keep(shape: Tuple[int, ...], dtype: torch.dtype) -> Tensor:  # what the backward pass reads
            return workspace.kept(shape, dtype, q.device, ctx) if train else q.new_empty(shape, dtype=dtype)

        y = q.new_empty(v.shape, dtype=acc)
        # the chunks' own contributions (U) become the states entering them (E; Z for the normaliser),
        # in place at inference, where nothing keeps them
        E = keep((M, grid.dirs() * Dk, v.shape[-1]), acc)
        Z = keep((M, grid.dirs() * Dk), acc) if normalize else None
        U = workspace("U", E.shape, acc, q.device) if train else E
        UZ = (workspace("UZ", Z.shape, acc, q.device) if train else Z) if normalize else None
        den = keep((M, C), acc) if normalize else None
        # training keeps every chunk's A and W (W is all ones, None, only when combined)
        As = keep((M, C, C), q.dtype) if train else None
        Ws = keep((M, C, C), acc) if train and not grid.combined else None
        for s in grid.blocks:  # within chunks, and each chunk's own contribution to the states
            n = s.stop - s.start
            qs, ks, vs = q[s], k[s], v[s]
            A = As[s] if train else workspace("A", (n, C, C), q.dtype, q.device)
            torch.bmm(qs, ks.transpose(1, 2), out=A)
            W = grid.matrix(s, n, C, acc, q.device, Ws[s] if Ws is not None else workspace("W", (n, C, C), acc, q.device))
            if W is not None:  # bfloat16 scores times the float32 decays rounded to bfloat16
                A.mul_(_low("W_low", W, A.dtype))
            _bmm_into(y[s], A, vs)
            own = grid.stacked(ks, "own", s)
            _bmm_into(U[s], own.transpose(1, 2), vs)
            if normalize:
                _sum_into(den[s], A, -1)
                _sum_into(UZ[s], own, -2)
        grid.states([U, UZ] if normalize else [U], [E, Z] if normalize else [E])
        for s in grid.blocks:  # both directions' states, read with one matmul
            read = grid.stacked(q[s], "read", s)
            _bmm_into(y[s], read, E[s], add=True)
            if normalize:
                _bmm_into(den[s].unsqueeze(-1), read, Z[s].unsqueeze(-1), add=True)
                y[s] /= den[s, :, None] + eps
        if train:
            ctx.save_for_backward(q, k, v, log_f, log_b, y, den, E, Z, As, Ws)
        ctx.N, ctx.bidirectional, ctx.normalize, ctx.eps = N, bidirectional, normalize, eps
        return y

    @staticmethod
    @first_derivatives_only("the chunk form")
    def backward(ctx, dy):
        q, k, v, log_f, log_b, y, den, E, Z, As, Ws = ctx.saved_tensors
        normalize, eps = ctx.normalize, ctx.eps
        M, C, Dk = q.shape
        N = ctx.N
        G = M // N
        grid = _grid(log_f, log_b, G, N, C, ctx.bidirectional, q.dtype, q.device)
        fwd, bwd = grid.fwd, grid.bwd
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        inv = 1.0 / (den + eps) if normalize else None
        if normalize and eps == 0:  # the rows padding L to whole chunks have no key (y = 0/0) and dy = 0:
            inv.masked_fill_(den == 0, 0.0)  # their do and dden must be 0, not 0 * inf
        # gradients w.r.t. the entering states (dE, dZ; in the forward's contribution buffers, free by
        # now), then w.r.t. the chunks' contributions (dU, dUZ)
        dE = workspace("U", E.shape, E.dtype, E.device)
        dZ = workspace("UZ", Z.shape, Z.dtype, Z.device) if normalize else None
        dU = workspace("dU", E.shape, E.dtype, E.device)
        dUZ = workspace("dUZ", Z.shape, Z.dtype, Z.device) if normalize else None
        # d loss / d (cumulative log-gate at t) = what t gains as a query minus what it gives as a key,
        # P_ij = M_ij (q_i . k_j)(do_i . v_j + dden_i); log_a_u enters every cumulative sum from u on.
        # A per-head gate's gradient, the sum of those over L, cancels to a few parts in 1e4 at L = 8192
        # (the rows and columns nearly cancel): it is summed pair by pair instead, heads[m, dir] collecting
        # each chunk's sum_{pairs} (gates crossed inside the chunk) P_ij (_crossings).
        per_head = [log_f is not None and log_f.shape[1] == 1, log_b is not None and log_b.shape[1] == 1]
        dcum_f = q.new_zeros(M, C) if fwd is not None and not per_head[0] else None
        dcum_b = q.new_zeros(M, C) if bwd is not None and not per_head[1] else None
        heads = q.new_zeros(M, 2) if any(per_head) else None
        cross = _crossings(C, q.dtype, q.device) if heads is not None else None
        for s in grid.blocks:
            n = s.stop - s.start
            A, W = As[s], Ws[s] if Ws is not None else None
            qs, ks, vs = q[s], k[s], v[s]
            if normalize:  # the gradients w.r.t. the unnormalised output and the normaliser
                dos = torch.mul(dy[s], inv[s, :, None], out=workspace("do", dy[s].shape, q.dtype, q.device))
                dden = torch.mul(dy[s], y[s], out=workspace("dden", dy[s].shape, q.dtype, q.device)).sum(-1)
                dden.mul_(inv[s]).neg_()
                if eps == 0:
                    dden.masked_fill_(inv[s] == 0, 0.0)
            else:
                dos, dden = dy[s], None
            dA = torch.bmm(dos, vs.transpose(1, 2), out=workspace("dA", (n, C, C), q.dtype, q.device))
            if normalize:
                dA += dden[:, :, None]
            torch.bmm(A.transpose(1, 2), dos, out=dv[s])
            if fwd is not None or bwd is not None:
                X = torch.mul(A, dA, out=workspace("X", (n, C, C), q.dtype, q.device))  # P_ij inside the chunk
                if heads is not None:  # pairs inside the chunk cross |i - j| gates of their direction
                    heads[s] += (X.view(n, 1, C * C) @ cross.pair.view(C * C, 2)).view(n, 2)
                # row minus column sums of each direction's pairs, without the diagonal, which crosses no
                # gate: in both sums it would cancel only to float32's rounding of itself, which under
                # strong decay outweighs every other pair (relative errors of 1e-3 at log-gates of -10, of
                # 1 at -30)
                if dcum_b is not None:  # the pairs above the diagonal
                    upper = torch.triu(X, 1, out=workspace("upper", X.shape, q.dtype, q.device))
                    dcum_b[s] += upper.sum(-2) - upper.sum(-1)
                if dcum_f is not None:  # and below it
                    X.tril_(-1)
                    dcum_f[s] += X.sum(-1) - X.sum(-2)
            if W is not None:
                dA.mul_(W)
            torch.bmm(dA, ks, out=dq[s])
            torch.bmm(dA.transpose(1, 2), qs, out=dk[s])
            read = grid.stacked(qs, "read", s)
            torch.bmm(read.transpose(1, 2), dos, out=dE[s])
            dread = torch.bmm(dos, E[s].transpose(1, 2), out=workspace("dread", read.shape, q.dtype, q.device))
            if normalize:
                dread.addcmul_(dden[:, :, None], Z[s, None, :])
                torch.bmm(read.transpose(1, 2), dden[:, :, None], out=dZ[s, :, None])
            grid.add_scaled(dq[s], dread, "read", s)
            if dcum_f is not None or dcum_b is not None or heads is not None:
                gain = torch.mul(read, dread, out=dread).view(n, C, -1, Dk).sum(-1)
                if dcum_f is not None:
                    dcum_f[s] += gain[..., 0]
                if dcum_b is not None:
                    dcum_b[s] -= gain[..., 1]
                if heads is not None:  # a query and the keys before (after) the chunk
                    heads[s, :gain.shape[-1]] += (gain * cross.query[:gain.shape[-1]].T).sum(1)
        grid.states([dE, dZ] if normalize else [dE], [dU, dUZ] if normalize else [dU], adjoint=True)
        if heads is not None:  # pairs on either side of a chunk cross all C of its gates
            for d, decay in enumerate((fwd, bwd)[:grid.dirs()]):
                part = slice(d * Dk, (d + 1) * Dk)
                spans = (dU[:, part] * E[:, part]).sum((1, 2))
                if normalize:
                    spans += (dUZ[:, part] * Z[:, part]).sum(1)
                heads[:, d] += C * spans * (decay.whole.view(-1) if decay is not None else 1.0)
        for s in grid.blocks:
            n = s.stop - s.start
            own = grid.stacked(k[s], "own", s)
            down = torch.bmm(v[s], dU[s].transpose(1, 2), out=workspace("down", own.shape, q.dtype, q.device))
            if normalize:
                down += dUZ[s, None, :]
            dv[s].baddbmm_(own, dU[s])
            grid.add_scaled(dk[s], down, "own", s)
            if dcum_f is not None or dcum_b is not None or heads is not None:
                give = torch.mul(own, down, out=down).view(n, C, -1, Dk).sum(-1)
                if dcum_f is not None:
                    dcum_f[s] -= give[..., 0]
                if dcum_b is not None:
                    dcum_b[s] += give[..., 1]
                if heads is not None:  # a key and the queries after (before) the chunk
                    heads[s, :give.shape[-1]] += (give * cross.key[:give.shape[-1]].T).sum(1)
        grads = []
        for d, (dcum, needed) in enumerate(((dcum_f, ctx.needs_input_grad[3]), (dcum_b, ctx.needs_input_grad[4]))):
            if not needed:
                grads.append(None)
            elif per_head[d]:
                grads.append(heads[:, d].view(G, N).double().sum(1, keepdim=True).to(q.dtype))
            else:
                grads.append(_suffix_sum(dcum, G) if dcum is not None else None)
        return dq, dk, dv, grads[0], grads[1], None, None, None, None


class _Crossings(NamedTuple):
    """How many of a chunk's gates a pair crosses, per direction (forward, backward): ``pair`` ``(C, C, 2)``
    for a query i and key j inside the chunk; ``query`` ``(2, C)`` for query i and keys outside it (before
    it forward, after it backward); ``key`` ``(2, C)`` for key j and queries outside it."""
    pair: Tensor
    query: Tensor
    key: Tensor


def _crossings(C: int, dtype: torch.dtype, device: torch.device) -> _Crossings:
    i = torch.arange(C, device=device, dtype=dtype)
    d = i[:, None] - i[None, :]
    into, out_of = i + 1, C - 1 - i  # gates from the chunk's start to i, and after i to its end
    return _Crossings(torch.stack([d.clamp(min=0), (-d).clamp(min=0)], -1), torch.stack([into, out_of]),
                      torch.stack([out_of, into]))


def _suffix_sum(dcum: Tensor, G: int) -> Tensor:
    """``(G*N, C)`` per-position gradients of cumulative sums -> ``(G, N*C)`` gradients of the
    log-gates; position 0's gate lies on no path."""
    flat = dcum.view(G, -1).double()
    out = flat.flip(-1).cumsum(-1).flip(-1)
    out[..., 0] = 0.0
    return out.to(dcum.dtype)


@eager_under_compile  # TorchDynamo cannot trace the reused buffers
def chunk_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor],
                    log_a_bwd: Optional[Tensor], causal: bool, chunk_size: int, normalize: bool = False,
                    eps: float = 1e-6) -> Tensor:
    """q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)``; gates ``(B, H, L)``, ``(b, h, 1)`` with b in {1, B} and
    h in {1, H} (one per head: its gradient is summed pair by pair), or None. Returns ``(B, H, L, Dv)``:
    ``((q k^T) * M) v``, divided row by row by ``sum_j (q k^T * M)_ij + eps`` if ``normalize``.

    q, k, v in float32 (or float64), or in bfloat16 for inference: the matmuls then run in bfloat16 and
    the output, the states, the decays and the normaliser stay float32 (the result is float32)."""
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, L)
    N = -(-L // C)
    pad = N * C - L
    G = B * H

    def per_token(g: Tensor, shift: bool) -> Tensor:  # (G, N*C), gates of 1 on the padding at the end
        # the backward direction as a forward-style decay on gates shifted by one:
        # b_i ... b_{j-1} = a'_{i+1} ... a'_j with a'_u = b_{u-1}
        g = g.expand(B, H, L)
        g = F.pad(g[..., :-1], (1, 0)) if shift else g
        return (F.pad(g, (0, pad)) if pad else g).reshape(G, N * C)

    def gate(g: Optional[Tensor], shift: bool) -> Optional[Tensor]:
        if g is None:
            return None
        if g.shape[-1] == 1:  # one per head, (G, 1): the same after the shift, where a'_0 lies on no path
            return g.expand(B, H, 1).reshape(G, 1)
        return per_token(g, shift)

    gates = [gate(log_a_fwd, False), gate(log_a_bwd, True) if not causal else None]
    if pad:  # zero tokens at the end: they contribute nothing in either direction
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))

    def chunks(x: Tensor) -> Tensor:  # (B, H, N*C, D) -> (B*H*N, C, D): a view unless x is strided
        return x.reshape(G * N, C, x.shape[-1]).contiguous()

    y = _ChunkAttention.apply(chunks(q), chunks(k), chunks(v), *gates, N, not causal, normalize, eps)
    y = y.view(B, H, N * C, Dv)
    return y[:, :, :L] if pad else y
