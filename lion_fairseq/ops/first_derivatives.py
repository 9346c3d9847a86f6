"""Backwards written out by hand (the chunk form, LION's and fla's kernels, the feature map's kernel) give
first derivatives only: asked for a graph of the gradient (``create_graph=True``), they raise.

``once_differentiable`` alone raises only where the incoming gradient itself requires grad
(``y.pow(2).sum()``). From ``y.sum()``, or ``autograd.grad`` with constant ``grad_outputs``, it returns
gradients with no graph, and a gradient penalty built on them silently misses the op's terms."""
import functools
from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

FORMS_WITH_SECOND_DERIVATIVES = "use form='parallel' or 'recurrent' (--lion-form), whose backward is autograd's"


def _refuse(what: str, instead: str) -> None:
    # autograd runs a backward in grad mode exactly when the graph of the gradient is asked for
    if torch.is_grad_enabled():
        raise RuntimeError(f"cannot differentiate twice through {what}: its backward is written out and gives "
                           f"first derivatives only, so a graph of the gradient (create_graph=True, as for a "
                           f"gradient penalty) would miss its terms; {instead}")


def first_derivatives_only(what: str, instead: str = FORMS_WITH_SECOND_DERIVATIVES) -> Callable:
    """Decorates an ``autograd.Function``'s ``backward``: ``once_differentiable``, and under
    ``create_graph=True`` an error naming ``what`` and what to do ``instead``."""

    def decorate(backward: Callable) -> Callable:
        once = once_differentiable(backward)

        @functools.wraps(backward)
        def checked(ctx, *grads):
            _refuse(what, instead)
            return once(ctx, *grads)

        return checked

    return decorate


class _Guard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, what: str, instead: str) -> Tensor:
        ctx.what, ctx.instead = what, instead
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: Tensor):
        _refuse(ctx.what, ctx.instead)
        return dy, None, None


def guard_first_derivatives(y: Tensor, what: str, instead: str = FORMS_WITH_SECOND_DERIVATIVES) -> Tensor:
    """``y``, whose backward raises under ``create_graph=True``: for an op whose autograd.Function is not
    ours (fla's), which a gradient of ``y`` reaches first."""
    return _Guard.apply(y, what, instead)
