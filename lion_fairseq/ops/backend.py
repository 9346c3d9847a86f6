"""Which implementation runs the chunk form: LION's own Triton kernel (``kernel.py``), fla's kernels
(``fla.py``) or the PyTorch chunk form (``chunk.py``, the reference and the CPU path).

The ``backend`` argument of ``lion_attention`` chooses, else the environment variable ``LION_BACKEND``
(``triton``, ``fla`` or ``torch``), else the default: fla on CUDA where it is installed, PyTorch
elsewhere. The Triton kernel is not the default on CUDA until a GPU run has checked its values and
gradients against the PyTorch form (``python -m lion_fairseq.benchmark.gpu``). A backend asked for that
cannot run says why, once per reason, and the call falls back: triton to fla to torch."""
import functools
import importlib.util
import os
import re
import warnings
from typing import Callable, Optional, Tuple

from torch import Tensor

BACKENDS = ("triton", "fla", "torch")
ENV = "LION_BACKEND"
MIN_TRITON = (3, 0)  # tl.dot's input_precision


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=5)


def version_numbers(text: str) -> Tuple[int, ...]:
    """The numbers that lead a version string, at most three: ``"3.6.0+git1a2b"`` -> ``(3, 6, 0)``."""
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


@functools.lru_cache(maxsize=None)
def _triton_missing() -> Optional[str]:
    """Why Triton cannot be used at all here, or None (asked once)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (it comes with CUDA builds of PyTorch)"
    import triton

    if version_numbers(triton.__version__) < MIN_TRITON:
        return f"it needs Triton >= {'.'.join(map(str, MIN_TRITON))}; this is {triton.__version__}"
    return None


def triton_unavailable(x: Tensor, head_dims: Tuple[int, int]) -> Optional[str]:
    """Why LION's Triton kernel cannot run on ``x`` (head sizes ``(Dk, Dv)``), or None."""
    missing = _triton_missing()
    if missing is not None:
        return missing
    from .kernel import kernel_unavailable

    return kernel_unavailable(x, head_dims)


def requested(backend: Optional[str]) -> Optional[str]:
    """The backend asked for by the argument, else by ``LION_BACKEND``, else None (the default)."""
    if backend is not None:
        return backend
    env = os.environ.get(ENV, "").strip().lower()
    if env and env not in BACKENDS:
        raise ValueError(f"{ENV} must be one of {BACKENDS} (or unset); got {env!r}")
    return env or None


def triton_chosen(x: Tensor, head_dims: Tuple[int, int]) -> bool:
    """Whether LION's Triton kernels are asked for where no ``backend`` argument is passed
    (``LION_BACKEND=triton``) and can run on ``x``: what the fused feature map follows, as the chunk form
    does (a kernel that cannot run says why from the chunk form's call)."""
    return requested(None) == "triton" and triton_unavailable(x, head_dims) is None


def fall_back_from_triton(x: Tensor, reason: str, fla_available: Callable[[Tensor], bool]) -> str:
    """Where the kernel cannot run on ``x``: say why (once per reason), and which backend runs instead."""
    fallback = "fla" if fla_available(x) else "torch"
    _warn_once(f"LION's Triton kernel cannot run here: {reason}. The chunk form runs on {fallback}.")
    return fallback


def chunk_backend(backend: Optional[str], x: Tensor, head_dims: Tuple[int, int],
                  fla_available: Callable[[Tensor], bool],
                  fla_unavailable: Callable[[Tensor], Optional[str]]) -> str:
    """``"triton"``, ``"fla"`` or ``"torch"``: what runs the chunk form on ``x``."""
    want = requested(backend)
    if want == "triton":
        reason = triton_unavailable(x, head_dims)
        return "triton" if reason is None else fall_back_from_triton(x, reason, fla_available)
    if want == "fla" and not fla_available(x):
        _warn_once(f"flash-linear-attention cannot run here: {fla_unavailable(x)}. The chunk form runs in PyTorch.")
        return "torch"
    if want is None:
        return "fla" if fla_available(x) else "torch"
    return want
