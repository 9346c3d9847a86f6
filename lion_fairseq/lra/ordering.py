"""Orderings of a ``height x width`` grid of pixels (or patches) as a sequence.

Data are stored row-major (pixel ``(r, c)`` at index ``r * width + c``). An ordering is a permutation
``perm`` of ``range(height * width)``: the sequence it produces is ``x[perm]`` (``perm[p]`` is the
row-major index of the p-th pixel visited) and ``inverse(perm)`` maps it back: ``x[perm][inv] == x``.

- ``row_major``: rows top to bottom, each left to right (the identity).
- ``row_snake``: rows top to bottom, alternately left to right and right to left (boustrophedon),
  so consecutive tokens are always neighbouring pixels.
- ``col_snake``: columns left to right, alternately top to bottom and bottom to top.

LION's "natural" image models (LION-D/S with two scans) use ``row_snake`` and ``col_snake`` together:
see :mod:`lion_fairseq.modules.two_scan_attention`.
"""

import torch
from torch import Tensor


def row_major(height: int, width: int) -> Tensor:
    """The identity ``(height * width,)`` long tensor."""
    return torch.arange(height * width)


def row_snake(height: int, width: int) -> Tensor:
    """``(height * width,)``: row-major indices, every odd row reversed."""
    grid = torch.arange(height * width).view(height, width).clone()
    grid[1::2] = grid[1::2].flip(-1)
    return grid.reshape(-1)


def col_snake(height: int, width: int) -> Tensor:
    """``(height * width,)``: column by column (the transposed grid), every odd column reversed."""
    grid = torch.arange(height * width).view(height, width).t().clone()  # grid[c, r] = r * width + c
    grid[1::2] = grid[1::2].flip(-1)
    return grid.reshape(-1)


_BUILDERS = {"row_major": row_major, "row_snake": row_snake, "col_snake": col_snake}
ORDERS = tuple(_BUILDERS)


def ordering(name: str, height: int, width: int) -> Tensor:
    """The permutation ``(height * width,)`` called ``name`` (one of :data:`ORDERS`)."""
    if name not in _BUILDERS:
        raise ValueError(f"ordering must be one of {ORDERS}; got {name!r}")
    if height < 1 or width < 1:
        raise ValueError(f"grid size must be positive; got {height} x {width}")
    return _BUILDERS[name](height, width)


def inverse(perm: Tensor) -> Tensor:
    """``inv`` with ``inv[perm[p]] = p``, so that ``x[perm][inv] == x``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv

