"""How every op takes log-gates: floored at ``LOG_GATE_MIN``.

exp() of anything below it is 0 in float32 and float64, so the floor changes no decay; it keeps
cumulative sums finite, where a gate of exactly 0 (log-gate -inf) would give ``-inf - -inf = nan`` in
their differences."""
from typing import Tuple

import torch
from torch import Tensor

LOG_GATE_MIN = -1e4


def check_gate(log_a: Tensor, name: str, shape: Tuple[int, ...]) -> None:
    """Refuse a log-gate that is not a float tensor broadcasting to ``shape`` (``(B, H, L)``, or ``(B, H)``
    for one step)."""
    if not isinstance(log_a, Tensor) or not log_a.is_floating_point():
        what = f"a {log_a.dtype} tensor" if isinstance(log_a, Tensor) else f"{type(log_a).__name__} {log_a!r}"
        raise ValueError(f"{name} must be a float tensor of log-gates (<= 0), or None for gate 1; got {what}")
    try:
        fits = torch.broadcast_shapes(log_a.shape, shape) == tuple(shape)
    except RuntimeError:
        fits = False
    if not fits:
        letters = "(B, H, L)" if len(shape) == 3 else "(B, H)"
        raise ValueError(f"{name} must be broadcastable to {letters} = {tuple(shape)}; got {tuple(log_a.shape)}")
