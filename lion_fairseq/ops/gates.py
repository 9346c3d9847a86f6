"""How every op takes log-gates: floored at ``LOG_GATE_MIN``.

exp() of anything below it is 0 in float32 and float64, so the floor changes no decay; it keeps
cumulative sums finite, where a gate of exactly 0 (log-gate -inf) would give ``-inf - -inf = nan`` in
their differences."""
from typing import Tuple

import torch
from torch import Tensor

LOG_GATE_MIN = -1e4


def check_gate_shape(log_a: Tensor, name: str, shape: Tuple[int, ...]) -> None:
    """Refuse a log-gate that does not broadcast to ``shape`` (``(B, H, L)``, or ``(B, H)`` for one step)."""
    try:
        fits = torch.broadcast_shapes(log_a.shape, shape) == tuple(shape)
    except RuntimeError:
        fits = False
    if not fits:
        letters = "(B, H, L)" if len(shape) == 3 else "(B, H)"
        raise ValueError(f"{name} must be broadcastable to {letters} = {tuple(shape)}; got {tuple(log_a.shape)}")
