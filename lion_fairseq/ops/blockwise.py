"""The bidirectional operator over a sequence given a block of tokens at a time, each direction's state
carried in from the blocks already seen: inference whose memory beyond the caller's input and output
does not grow with L (a layer can then run its projections and FFN block by block too).

For a block of tokens s..e-1 the mask splits at the block's edges:
``M_ij = (f_s ... f_i) (f_{j+1} ... f_{s-1})`` for ``j < s <= i`` and
``M_ij = (b_i ... b_{e-1}) (b_e ... b_{j-1})`` for ``i < e <= j``, so the tokens before the block reach
it through the left state ``S = sum_{j<s} (f_{j+1} ... f_{s-1}) k_j v_j^T`` (``lion_step``'s state) and
those after it through the right state ``S' = sum_{j>=e} (b_e ... b_{j-1}) k_j v_j^T``."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .attention import lion_attention
from .float32 import accumulation_dtype, float32_math
from .gates import LOG_GATE_MIN
from .padding import mask_padded_keys
from .recurrent import State, causal_state


def _carry(old: Optional[State], log_a: Optional[Tensor], new: State) -> State:
    """``decay * old + new`` with ``decay`` the product of the block's gates ``log_a`` ``(B, H, n)``."""
    if old is None:
        return new
    S, z = old
    if log_a is not None:
        d = log_a.double().sum(-1).exp().to(S.dtype)
        S, z = d[..., None, None] * S, d[..., None] * z
    return S + new[0], z + new[1]


def _gates(log_a: Optional[Tensor], k: Tensor) -> Optional[Tensor]:
    """A broadcastable log-gate as ``(B, H, n)`` float64, like k's first three dimensions, floored at
    ``LOG_GATE_MIN`` as ``lion_attention`` floors it, so that every op here takes gates its way."""
    return log_a.double().clamp(min=LOG_GATE_MIN).expand(k.shape[:3]) if log_a is not None else None


@float32_math
def state_after(left: Optional[State], k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None) -> State:
    """The left state after the block from the one before it (None at the start of the sequence).
    k: ``(B, H, n, Dk)``, v: ``(B, H, n, Dv)``, log_a_fwd: ``(B, H, n)`` or None, key_padding_mask ``(B, n)``."""
    k, v = mask_padded_keys(k, v, key_padding_mask)
    f = _gates(log_a_fwd, k)
    return _carry(left, f, causal_state(k, v, f))


@float32_math
def state_before(right: Optional[State], k: Tensor, v: Tensor, log_a_bwd: Optional[Tensor],
                 key_padding_mask: Optional[Tensor] = None) -> State:
    """The right state at the block's first token from the one after its last (None at the end of the
    sequence): the left state of the block read backwards."""
    k, v = mask_padded_keys(k, v, key_padding_mask)
    b = _gates(log_a_bwd, k)
    return _carry(right, b, causal_state(k.flip(-2), v.flip(-2), b.flip(-1) if b is not None else None))


def _read(q: Tensor, state: Optional[State], log_decay: Optional[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
    """``(q_i * decay_i) S`` and ``(q_i * decay_i) . z`` for each token, decay_i = exp(log_decay_i) <= 1."""
    if state is None:
        return None
    S, z = state
    if log_decay is not None:
        q = q * log_decay.exp().to(q.dtype)[..., None]
    return q @ S, q @ z[..., None]


@float32_math
def block_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor], log_a_bwd: Optional[Tensor],
                    left: Optional[State], right: Optional[State], *, form: str = "recurrent",
                    normalize: bool = True, key_padding_mask: Optional[Tensor] = None, chunk_size: int = 64,
                    eps: float = 1e-6) -> Tensor:
    """The bidirectional ``lion_attention`` outputs of one block of a longer sequence.

    q, k: ``(B, H, n, Dk)``; v: ``(B, H, n, Dv)``; log-gates ``(B, H, n)`` (or broadcastable) or None, the
    block's slice of the sequence's ``log_a_fwd``/``log_a_bwd``; left: ``state_after`` of the blocks before
    (None for the first), right: ``state_before`` of the blocks after (None for the last). Inside the block
    ``form`` computes. Returns ``(B, H, n, Dv)`` in v's dtype, equal to the same rows of ``lion_attention``
    over the whole sequence."""
    B, H, n, _ = q.shape
    dtype = accumulation_dtype(v)
    f, b = _gates(log_a_fwd, q), _gates(log_a_bwd, q)
    qd, vd = q.to(dtype), v.to(dtype)
    # the ones column makes the block's own normaliser come out beside its numerator
    inner = lion_attention(qd, k.to(dtype), torch.cat([vd, vd.new_ones(B, H, n, 1)], -1), log_a_fwd, log_a_bwd,
                           form=form, normalize=False, key_padding_mask=key_padding_mask, chunk_size=chunk_size)
    num, den = inner[..., :-1], inner[..., -1:]
    # decay from the block's start to i (f_s ... f_i) and from i to its end (b_i ... b_{e-1})
    for part in (_read(qd, left, f.cumsum(-1) if f is not None else None),
                 _read(qd, right, b.flip(-1).cumsum(-1).flip(-1) if b is not None else None)):
        if part is not None:
            num, den = num + part[0], den + part[1]
    y = num / (den + eps) if normalize else num
    return y.to(v.dtype)
