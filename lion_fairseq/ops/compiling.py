"""``eager_under_compile``: a function that ``torch.compile`` runs as in eager mode, a graph break with the
ops around it compiled. The chunk form's reused buffers (``workspace.py``) are beyond TorchDynamo's tracing,
and the Triton and fla launches are run the way they were checked."""
import functools
import sys
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def compiling() -> bool:
    """Whether TorchDynamo is tracing this call (a constant to it)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    if is_compiling is not None:
        return is_compiling()
    dynamo = sys.modules.get("torch._dynamo")  # nothing is compiled before it is imported
    return dynamo is not None and dynamo.is_compiling()


def eager_under_compile(fn: F) -> F:
    """``fn``, run by ``torch.compile`` as in eager mode. ``torch.compiler.disable`` is applied as TorchDynamo
    traces a call: as a decorator it would import TorchDynamo (1.3 s) with the ops."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return torch.compiler.disable(fn)(*args, **kwargs) if compiling() else fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
