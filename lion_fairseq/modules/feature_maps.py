"""Feature maps phi applied to queries and keys, per head: ``(..., D) -> (..., D)``."""
from typing import Callable, Dict

import torch.nn.functional as F
from torch import Tensor

from ..ops.backend import triton_chosen


def elu_plus_one(x: Tensor) -> Tensor:
    """``elu(x) + 1 > 0``: LION-LIT's map (linear attention's usual one)."""
    return F.elu(x) + 1.0


def silu_norm(x: Tensor) -> Tensor:
    """``(silu(x) + 0.5) / ||silu(x) + 0.5||`` over the head dimension: LION-D/S's map, unit rows."""
    if triton_chosen(x, (x.shape[-1], x.shape[-1])):  # a pass each way, not PyTorch's 4 and about 7
        from ..ops.feature_kernel import silu_norm_kernel

        return silu_norm_kernel(x)
    # silu(x) + 0.5 >= 0.22 > 0, so scores are positive and the row normaliser never vanishes
    y = F.silu(x) + 0.5
    return y / y.norm(dim=-1, keepdim=True)


def identity(x: Tensor) -> Tensor:
    """No map: the released MLM recipe's ablation (scores of either sign)."""
    return x


FEATURE_MAPS: Dict[str, Callable[[Tensor], Tensor]] = {
    "elu": elu_plus_one,
    "silu_norm": silu_norm,
    "identity": identity,
}
# maps whose scores can be negative or zero: the row normaliser could divide by ~0
SIGNED_FEATURE_MAPS = ("identity",)
