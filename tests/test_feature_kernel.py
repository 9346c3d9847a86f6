"""LION-D/S's feature map as a Triton kernel (``ops/feature_kernel.py``) against the PyTorch form it
replaces, under Triton's CPU interpreter (or on a GPU): values and gradients, in fairseq's layout, and
chosen exactly where LION's Triton kernels are."""
import os

import pytest
import torch
import torch.nn.functional as F

from lion_fairseq.modules import feature_maps

needs_kernel = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="the kernel runs under TRITON_INTERPRET=1 or on CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        import triton_interpreter

        triton_interpreter.install()


def reference(x: torch.Tensor) -> torch.Tensor:
    s = F.silu(x.double()) + 0.5
    return s / s.norm(dim=-1, keepdim=True)


def fairseq_heads(T: int, B: int, H: int, D: int, dtype, seed: int = 0) -> torch.Tensor:
    """A ``(B, H, T, D)`` view of a ``(T, B, H*D)`` projection, as LionAttention hands it to phi."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(T, B, H * D, generator=g)).to(dtype).to(DEVICE)
    return x.view(T, B, H, D).permute(1, 2, 0, 3)


@needs_kernel
@pytest.mark.parametrize("D", [32, 64, 100, 128])
@pytest.mark.parametrize("layout", ["fairseq", "contiguous", "strided"])
def test_kernel_equals_float64_feature_map(D, layout):
    from lion_fairseq.ops.feature_kernel import silu_norm_kernel

    x = fairseq_heads(37, 3, 2, D, torch.float32)
    if layout == "contiguous":
        x = x.contiguous()
    elif layout == "strided":  # every other row: not dense, read from a copy
        x = x[:, :, ::2]
    x.requires_grad_()
    weight = torch.randn(x.shape, dtype=torch.float64, device=DEVICE)
    y = silu_norm_kernel(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    (y.double() * weight).sum().backward()
    x64 = x.detach().double().requires_grad_()
    y64 = reference(x64)
    (y64 * weight).sum().backward()
    assert (y.double() - y64).abs().max() < 1e-6
    assert (x.grad.double() - x64.grad).abs().max() < 1e-5 * x64.grad.abs().max()


@needs_kernel
def test_kernel_refuses_a_second_derivative():
    """Asked for a graph of the gradient (``create_graph=True``), the kernel's backward raises rather than
    return a gradient that silently misses its terms."""
    from lion_fairseq.ops.feature_kernel import silu_norm_kernel

    x = fairseq_heads(9, 2, 2, 32, torch.float32).requires_grad_()
    with pytest.raises(RuntimeError, match="differentiate twice through the feature map's Triton kernel"):
        torch.autograd.grad(silu_norm_kernel(x).sum(), x, create_graph=True)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_16bit_rounds_once(dtype):
    """16-bit inputs: float32 inside and one rounding of the result, so no further from float64 than that
    rounding (PyTorch's form rounds after each of its passes)."""
    from lion_fairseq.ops.feature_kernel import silu_norm_kernel

    x = fairseq_heads(50, 2, 3, 64, dtype, seed=1).requires_grad_()
    dy = torch.randn(x.shape, device=DEVICE).to(dtype)
    y = silu_norm_kernel(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = reference(x64)
    y64.backward(dy.double())
    unit = torch.finfo(dtype).eps  # the spacing at 1: a result's rounding is at most half of it, relative
    assert y.dtype == dtype and ((y.double() - y64).abs() / y64.abs()).max() <= unit / 2
    rel = (x.grad.double() - x64.grad).norm() / x64.grad.norm()
    assert rel < 2 * unit


def test_chosen_where_the_triton_kernels_are(monkeypatch):
    """phi runs on the kernel exactly where LION_BACKEND=triton picks LION's Triton kernels and they can
    run; otherwise (and on a CPU without the interpreter) the PyTorch form."""
    import lion_fairseq.ops.feature_kernel as fk

    calls = []
    monkeypatch.setattr(fk, "silu_norm_kernel", lambda x: calls.append(x.shape) or torch.zeros_like(x))
    x = torch.randn(2, 3, 5, 8, device=DEVICE)
    for env in ("torch", "fla", None):
        if env:
            monkeypatch.setenv("LION_BACKEND", env)
        else:
            monkeypatch.delenv("LION_BACKEND", raising=False)
        assert torch.allclose(feature_maps.silu_norm(x), reference(x).float(), atol=1e-6) and not calls
    monkeypatch.setenv("LION_BACKEND", "triton")
    runnable = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    feature_maps.silu_norm(x)
    assert calls == ([x.shape] if runnable else [])
    feature_maps.silu_norm(torch.randn(2, 3, 5, 200, device=DEVICE))  # a head size the kernels do not take
    assert len(calls) == (1 if runnable else 0)


@needs_kernel
def test_kernel_refusal_names_the_backend_to_run_without():
    """The feature map's kernel runs under LION_BACKEND=triton in any form: its refusal of a second
    derivative says to run without that, not to switch --lion-form (which would not avoid it)."""
    from lion_fairseq.ops.feature_kernel import silu_norm_kernel

    x = fairseq_heads(9, 2, 2, 32, torch.float32).requires_grad_()
    with pytest.raises(RuntimeError, match=r"feature map's Triton kernel.*; run without LION_BACKEND=triton$"):
        torch.autograd.grad(silu_norm_kernel(x).sum(), x, create_graph=True)
