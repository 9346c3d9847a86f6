"""The recurrent form: two RNN scans with a ``Dk x Dv`` state per head, and the one-token step."""
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .float32 import accumulation_dtype, check_eps, check_float, float32_math, needs_grad
from .gates import LOG_GATE_MIN, check_gate
from .padding import checked_padding_mask, mask_padded_keys

State = Tuple[Tensor, Tensor]  # (S (B, H, Dk, Dv), z (B, H, Dk)), float32 (float64 for float64 inputs)


def _scan(q: Tensor, k: Tensor, v: Tensor, log_a: Optional[Tensor], strict: bool, reverse: bool) -> Tensor:
    """``o_i = q_i S_i`` with ``S_i = a_i S_{i-1} + k_i v_i^T`` (``S_{i+1}`` when ``reverse``).

    ``strict`` reads the state before the current token is added (the diagonal excluded).
    q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)``; log_a: ``(B, H, L)`` or None. Returns ``(B, H, L, Dv)``.
    """
    B, H, L, Dk = k.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    inplace = not needs_grad(q, k, v, log_a)
    # token t's rows, in the shapes the loop multiplies. For a backward all at once (unbind): a slice per token
    # would get a full-length gradient each in the backward, O(L^2) in all. Without it one view at a time:
    # L views held at once cost about 0.5 KB each
    rows = (lambda x: functools.partial(x.select, 2)) if inplace else (lambda x: x.unbind(2).__getitem__)
    q_t, k_t, v_t = rows(q.unsqueeze(3)), rows(k.unsqueeze(4)), rows(v.unsqueeze(3))
    gate_t = rows(log_a.exp()[..., None, None]) if log_a is not None else None
    # without a backward, written in place: a list of small per-token outputs would pin the freed states between
    # them in the allocator and grow memory by a state per token; with it, concatenated once (a write per
    # token into one output would cost the backward what a slice does)
    out = q.new_empty(B, H, L, 1, v.shape[-1]) if inplace else None
    ys = None if inplace else [None] * L
    for t in (range(L - 1, -1, -1) if reverse else range(L)):
        if gate_t is not None:
            S = S.mul_(gate_t(t)) if inplace else gate_t(t) * S
        if strict:
            y = q_t(t) @ S
        # in place, fused: no D x D temporary per token
        S = S.addcmul_(k_t(t), v_t(t)) if inplace else S + k_t(t) * v_t(t)
        if not strict:
            y = q_t(t) @ S
        if inplace:
            out.select(2, t).copy_(y)
        else:
            ys[t] = y
    return out.squeeze(3) if inplace else torch.cat(ys, 2)


def recurrent_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor],
                        log_a_bwd: Optional[Tensor], causal: bool) -> Tensor:
    """Forward scan (diagonal included) plus, unless ``causal``, a backward scan (diagonal excluded,
    so it is counted once). ``v`` carries the normaliser as its last column. Returns ``(B, H, L, Dv)``."""
    out = _scan(q, k, v, log_a_fwd, strict=False, reverse=False)
    if not causal:
        out = out + _scan(q, k, v, log_a_bwd, strict=True, reverse=True)
    return out


@float32_math
def decayed(S: Tensor, z: Tensor, log_a: Tensor) -> State:
    """A state ``S`` ``(B, H, Dk, Dv)``, ``z`` ``(B, H, Dk)`` times the gates ``exp(log_a)`` ``(B, H)`` (or
    broadcastable), computed in S's dtype."""
    f = log_a.to(S.dtype).exp()
    return f[..., None, None] * S, f[..., None] * z


@float32_math  # under autocast, q_t S would run in 16 bits: S sums the whole context (past fp16's 65504)
def lion_step(q_t: Tensor, k_t: Tensor, v_t: Tensor, log_a_t: Optional[Tensor] = None,
              state: Optional[State] = None, *, normalize: bool = True, eps: float = 1e-6) -> Tuple[Tensor, State]:
    """One token of the causal recurrence, for decoding.

    q_t, k_t: ``(B, H, Dk)``; v_t: ``(B, H, Dv)`` (or one-token slices ``(B, H, 1, D)`` of
    ``lion_attention``'s inputs, giving ``y_t`` ``(B, H, 1, Dv)``); log_a_t: ``(B, H)`` (or broadcastable,
    ``(B, H, 1)`` too, and ``lion_attention``'s one gate per head ``(H, 1)``), ``None`` for gate 1; state:
    ``(S, z)`` with S ``(B, H, Dk, Dv)`` and z ``(B, H, Dk)`` in float32 (float64 for float64 inputs), ``None``
    at the start. Returns ``y_t`` ``(B, H, Dv)`` in ``v_t.dtype`` and the new state.
    ``S_t = f_t S_{t-1} + k_t v_t^T``, ``z_t = f_t z_{t-1} + k_t``, ``y_t = q_t S_t / (q_t . z_t + eps)``.
    """
    if isinstance(log_a_t, Tensor) and log_a_t.dim() == 3 and log_a_t.shape[-1] == 1:  # (B, H, 1): this token's
        log_a_t = log_a_t.squeeze(-1)
    if q_t.dim() == 4 and q_t.shape[2] == 1 and k_t.dim() == v_t.dim() == 4 and k_t.shape[2] == v_t.shape[2] == 1:
        y, state = lion_step(q_t.squeeze(2), k_t.squeeze(2), v_t.squeeze(2), log_a_t, state, normalize=normalize,
                             eps=eps)
        return y.unsqueeze(2), state
    if q_t.dim() != 3 or q_t.shape != k_t.shape:
        raise ValueError(f"q_t and k_t must both be (B, H, Dk); got q_t {tuple(q_t.shape)}, k_t {tuple(k_t.shape)}")
    if v_t.dim() != 3 or v_t.shape[:2] != q_t.shape[:2]:
        raise ValueError(f"v_t must be (B, H, Dv) with the B, H of q_t; got {tuple(v_t.shape)}")
    check_float(q_t=q_t, k_t=k_t, v_t=v_t)
    check_eps(eps)
    H = q_t.shape[1]
    if isinstance(log_a_t, Tensor) and H > 1 and log_a_t.shape == (H, 1):
        # lion_attention's per-head gate, as it broadcasts there; against (B, H) it read as one per batch row
        log_a_t = log_a_t.reshape(1, H)
    if log_a_t is not None:
        check_gate(log_a_t, "log_a_t", tuple(q_t.shape[:2]))
    dtype = accumulation_dtype(v_t)
    q, k, v = q_t.to(dtype), k_t.to(dtype), v_t.to(dtype)
    kv = k[..., :, None] * v[..., None, :]
    if state is None:
        S, z = kv, k
    else:
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise ValueError(f"state must be the pair (S, z) that lion_step returned (or None to start); got "
                             f"{type(state).__name__}{f' of {len(state)}' if isinstance(state, (tuple, list)) else ''}")
        S, z = state
        if S.shape != kv.shape or z.shape != k.shape:
            raise ValueError(f"state must be (S, z) of shapes {tuple(kv.shape)} and {tuple(k.shape)}; "
                             f"got {tuple(S.shape)} and {tuple(z.shape)}")
        if log_a_t is not None:
            S, z = decayed(S, z, log_a_t.expand(q.shape[:2]))
        S, z = S + kv, z + k
    y = (q[..., None, :] @ S).squeeze(-2)
    if normalize:
        y = y / ((q * z).sum(-1, keepdim=True) + eps)
    return y.to(v_t.dtype), (S, z)


@float32_math
def causal_state(k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor] = None,
                 key_padding_mask: Optional[Tensor] = None) -> State:
    """The state ``(S, z)`` that ``lion_step`` holds after the last of L tokens, in one pass: the prefill
    of decoding without a token loop. ``S = sum_j (f_{j+1} ... f_{L-1}) k_j v_j^T``.

    k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)``; log_a_fwd: ``(B, H, L)`` or broadcastable, or None;
    key_padding_mask: ``(B, L)`` bool; padded tokens are skipped (their keys and gates), so a left- or
    right-padded prompt leaves the state of its real tokens. Returns S ``(B, H, Dk, Dv)`` and z ``(B, H, Dk)`` in float32.
    """
    if k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k must be (B, H, L, Dk) and v (B, H, L, Dv) with k's (B, H, L); got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    check_float(k=k, v=v)
    B, H, L, _ = k.shape
    if key_padding_mask is not None:
        key_padding_mask = checked_padding_mask(key_padding_mask, B, L)
    if log_a_fwd is not None:
        check_gate(log_a_fwd, "log_a_fwd", (B, H, L))
    dtype = accumulation_dtype(v)
    k, v = mask_padded_keys(k.to(dtype), v.to(dtype), key_padding_mask)
    if log_a_fwd is not None:
        # exp(sum_{u>j} log f_u) from a float64 suffix sum: every argument <= 0, exact near the end;
        # floored as lion_attention floors gates (a gate of 0 would give -inf - -inf = nan)
        a = log_a_fwd.double().clamp(min=LOG_GATE_MIN).expand(B, H, L)
        if key_padding_mask is not None:
            a = a.masked_fill(key_padding_mask[:, None, :], 0.0)
        suffix = a.flip(-1).cumsum(-1).flip(-1) - a
        k = k * suffix.exp().to(dtype)[..., None]
    return k.transpose(-1, -2) @ v, k.sum(-2)
