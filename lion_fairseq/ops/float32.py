"""``float32_math``: the operator's functions run with autocast off.

Under fairseq's ``--amp`` the forward runs inside ``torch.autocast`` (fp16), which casts the inputs of
every matmul to fp16 whatever their dtype, so an op that converts to float32 first would still multiply
in fp16, and a row sum over L keys passes fp16's 65504. The ops' float32 is meant: they opt out."""
import contextlib
import functools
import math
import numbers
from typing import Callable, Optional, TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable)


@functools.lru_cache(maxsize=None)
def _cuda() -> bool:
    return torch.cuda.is_available()


def float32_math(fn: F) -> F:
    """Run ``fn`` with autocast disabled on the CPU and on CUDA; its own casts then decide the dtypes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        cuda = _cuda()
        if not (autocast_enabled("cpu") or cuda and autocast_enabled("cuda")):
            return fn(*args, **kwargs)  # nothing to turn off: two contexts cost a decoding step 15-20 us
        # without CUDA there is no CUDA autocast to turn off, and older torch warned at every
        # torch.autocast("cuda") there, even a disabled one (pytorch issue 83733)
        with torch.autocast("cpu", enabled=False), (
                torch.autocast("cuda", enabled=False) if cuda else contextlib.nullcontext()):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def autocast_enabled(device: str) -> bool:
    """Whether autocast is on for ``device`` (``"cpu"``, ``"cuda"``, ...) here."""
    try:
        return torch.is_autocast_enabled(device)
    except TypeError:  # torch < 2.4 asks per device type
        return torch.is_autocast_enabled() if device == "cuda" else (
            device == "cpu" and torch.is_autocast_cpu_enabled())


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether a backward will run through any of ``tensors`` (None among them is fine): grad mode on and
    one of them requiring its gradient."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def accumulation_dtype(x: Tensor) -> torch.dtype:
    """The dtype the ops accumulate in for an input like ``x``: float64 for float64 (the references),
    float32 for every other dtype."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_float(**tensors: Tensor) -> None:
    """Refuse integer or bool inputs by name: the ops would compute in float and cast the result back,
    truncating it without a word."""
    for name, x in tensors.items():
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got {x.dtype}")


def check_eps(eps: object) -> None:
    """The row normaliser's ``eps`` is a finite number >= 0: below 0 a row sum can be cancelled to zero."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite number >= 0; got {eps!r}")
