"""Non-causal linear attention of queries over a fixed memory (cross-attention over an encoder's output):
the memory's state ``(S, z) = (sum_j k_j v_j^T, sum_j k_j)`` is computed once, and each query reads it, so
a query costs O(Dk * Dv) whatever the memory's length."""
from typing import Optional

from torch import Tensor

from .float32 import float32_math
from .recurrent import State, causal_state


def memory_state(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> State:
    """``(S, z)`` of the memory: k ``(B, H, M, Dk)`` feature-mapped, v ``(B, H, M, Dv)``, key_padding_mask
    ``(B, M)`` True at padding (left out). Returns S ``(B, H, Dk, Dv)`` and z ``(B, H, Dk)`` in float32
    (float64 for float64 inputs): the causal state after the last token, with no decay."""
    return causal_state(k, v, None, key_padding_mask)


@float32_math
def read_memory(q: Tensor, state: State, *, normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """``y_i = q_i S / (q_i . z + eps)`` (``q_i S`` if not ``normalize``) for q ``(B, H, T, Dk)``
    feature-mapped; returns ``(B, H, T, Dv)`` in the state's dtype (float32: an unnormalised sum over the
    memory can pass fp16's range)."""
    S, z = state
    qs = q.to(S.dtype)
    y = qs @ S
    if normalize:
        y = y / (qs @ z[..., None] + eps)
    return y
