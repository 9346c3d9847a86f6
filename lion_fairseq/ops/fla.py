"""LION on flash-linear-attention's Triton kernels (CUDA): each direction is one call of fla's
``chunk_simple_gla``, the causal linear attention with one scalar log-decay per token and head,
``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * q_t S_t``
(fla-core 0.6.0: ``fla/ops/simple_gla/chunk.py`` lines 238-355, its naive twin
``fla/ops/simple_gla/naive.py`` lines 61-94).

fla is optional (``pip install fla-core``, the ``fla`` extra); ``fla_available`` says whether it can run
on a tensor, ``fla_backward_refused`` whether fla's own gated backward is refused on this GPU/Triton (the
gradients then come from fla's forward kernel), and ``LION_FLA=0`` turns it off (the PyTorch chunk form
runs instead).

Inputs reach fla in float32 whatever their dtype: fla returns its outputs, and stores the states between
chunks, in the input dtype, and LION's numerator and row sum grow with L (LION-LIT's pass fp16's 65504
near L = 1000). In float32 every sum that grows with L stays float32, on Ampere and later the kernels'
products run in TF32 (Triton's default), and the attention's own kernel is a small part of a layer's
work: both directions take about ``4 (chunk + D)`` multiply-adds per token and channel against the
projections' and FFN's ``12 C``, 6% at C = 768 with chunks of 64 and D = 64."""
import functools
import importlib.util
import os
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import version_numbers
from .compiling import eager_under_compile
from .first_derivatives import first_derivatives_only, guard_first_derivatives
from .float32 import needs_grad

FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the normaliser's column of ones makes Dv odd (65 for D = 64): zero columns up to a multiple of 8 keep
# every row 32-byte aligned, and head dims even, as fla's 16-bit kernels require (chunk_o.py:604-606)
ALIGN = 8


@functools.lru_cache(maxsize=None)
def _load() -> Optional[Callable]:
    """fla's ``chunk_simple_gla``, or None when it is not installed or does not import (tried once)."""
    if importlib.util.find_spec("fla") is None:
        return None
    too_old = _older_than_fla_needs()
    if too_old is not None:
        warnings.warn(f"flash-linear-attention is installed, but {too_old}; LION's chunk form runs in PyTorch instead")
        return None
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # installed but broken (say a Triton that does not fit): falling back silently would hide it
        warnings.warn(f"flash-linear-attention is installed but does not import ({e!r}); "
                      "LION's chunk form runs in PyTorch instead")
        return None
    return chunk_simple_gla


# fla-core 0.6's requirements, which pip applies only to its `cuda` extra, not to the `fla-core` that
# lion-fairseq's `fla` extra installs (fla itself only warns below Triton 3.3)
FLA_NEEDS = {"torch": (2, 7), "triton": (3, 3)}


def _older_than_fla_needs() -> Optional[str]:
    """What here is older than fla's kernels need, in words, or None."""
    versions = {"torch": torch.__version__}
    if importlib.util.find_spec("triton") is not None:
        import triton

        versions["triton"] = triton.__version__
    for name, text in versions.items():
        if version_numbers(text) < FLA_NEEDS[name]:
            needed = ".".join(map(str, FLA_NEEDS[name]))
            return f"its kernels need {name} >= {needed} and this is {name} {text}"
    return None


def fla_unavailable(x: Tensor) -> Optional[str]:
    """Why ``x`` cannot go through fla, or None: it must be on CUDA, in a dtype fla's kernels take, fla
    must import, and the environment variable ``LION_FLA`` must not turn it off (``0``, ``false``, ``no``, ``off``).
    Another value raises: a misspelt ``LION_FLA`` would otherwise leave fla on without a word."""
    value = os.environ.get("LION_FLA", "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return f"LION_FLA={value} turns it off"
    if value not in ("1", "true", "yes", "on", ""):
        raise ValueError(f"LION_FLA must be 0 (fla off) or 1 (on where it can run, the default); got {value!r}")
    if not x.is_cuda:
        return "it runs on CUDA tensors only"
    if x.dtype not in FLA_DTYPES:
        return f"it takes float32, bfloat16 or float16 inputs; got {x.dtype}"
    if _load() is None:
        return _not_loaded_reason()
    return None


@functools.lru_cache(maxsize=None)
def _not_loaded_reason() -> str:
    """Why ``_load`` found no kernel (asked once: ``fla_unavailable`` runs at every call of the chunk form)."""
    too_old = _older_than_fla_needs() if importlib.util.find_spec("fla") is not None else None
    return too_old or "flash-linear-attention is not installed (pip install fla-core)"


def fla_available(x: Tensor) -> bool:
    """True when ``x`` can go through fla (``fla_unavailable`` gives no reason against it)."""
    return fla_unavailable(x) is None


def fla_backward_refused(x: Tensor) -> Optional[str]:
    """Why fla's own backward of a *gated* call (per-token or per-head decay: LION-D and LION-S) cannot run
    on ``x``'s device, or None. fla 0.6 raises there on Hopper GPUs with 3.4 <= Triton < 3.7.1, whose
    results it computes wrongly (fla issue #640; fla/ops/common/chunk_o.py, chunk_bwd_dqkwg; tilelang does
    not serve simple_gla). fla's forward is right there (measured on an H200 with Triton 3.6.0), so the
    gradients are then computed by fla's forward kernel (``_GLAFromForwardKernels``)."""
    if not x.is_cuda:
        return None
    import triton

    major, _ = torch.cuda.get_device_capability(x.device)
    if major == 9 and (3, 4) <= version_numbers(triton.__version__) < (3, 7, 1):
        return (f"flash-linear-attention's gated backward is wrong on Hopper GPUs with Triton {triton.__version__} "
                "(fla issue #640)")
    return None


def _kernel(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor]) -> Tensor:
    kernel = _load()
    if kernel is None:
        raise RuntimeError("flash-linear-attention's chunk_simple_gla does not import: pip install fla-core")
    return kernel(q, k, v, g=g, scale=1.0)[0]


def _reversed_gates(g: Tensor) -> Tensor:
    """The gates of the same mask read backwards: on sequences flipped along L, ``M_ij`` (i >= j) is
    ``exp(g'_{i'+1} + ... + g'_{j'})`` with ``g'_p = g_{L-p}`` (``g'_0`` meets no pair: zero)."""
    return F.pad(g.flip(1)[:, :-1], (0, 0, 1, 0))


class _GLAFromForwardKernels(torch.autograd.Function):
    """``_gla`` whose backward is three more calls of fla's *forward* kernel, for where fla's own gated
    backward is refused (``fla_backward_refused``). With ``A_ij = M_ij (q_i . k_j)(do_i . v_j)``, i >= j:

    - ``dq_i = sum_{j <= i} M_ij (do_i . v_j) k_j``: the same causal attention of (do, v, k);
    - ``dk_j = sum_{i >= j} M_ij (do_i . v_j) q_i`` and ``dv_j = sum_{i >= j} M_ij (q_i . k_j) do_i``: causal
      attentions of (v, do, q) and (k, q, do) on the sequences flipped, with ``_reversed_gates``;
    - ``dg_t = sum_{i >= t > j} A_ij = sum_{i >= t} q_i . dq_i - sum_{j >= t} k_j . dk_j``, since
      ``q_i . dq_i`` sums row i of A and ``k_j . dk_j`` column j: a reversed cumulative sum, in float64."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> Tensor:
        ctx.save_for_backward(q, k, v, g)
        return _kernel(q, k, v, g)

    @staticmethod
    @first_derivatives_only("flash-linear-attention's kernels (the chunk form)")
    def backward(ctx, do: Tensor):
        q, k, v, g = ctx.saved_tensors
        do = do.to(v.dtype).contiguous()
        rg = _reversed_gates(g)
        dq = _kernel(do, v, k, g)
        q_r, do_r = q.flip(1), do.flip(1)
        dk = _kernel(v.flip(1), do_r, q_r, rg).flip(1)
        dv = _kernel(k.flip(1), q_r, do_r, rg).flip(1)
        rows = (q * dq).sum(-1, dtype=torch.float64) - (k * dk).sum(-1, dtype=torch.float64)
        dg = rows.flip(1).cumsum(1).flip(1)
        dg[:, 0] = 0  # g_0 meets no pair: the sum above is zero there up to round-off
        return dq, dk, dv, dg.to(g.dtype)


def _gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor]) -> Tensor:
    """fla's ``o_i = sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j`` on fla's layout: q, k
    ``(B, L, H, Dk)``, v ``(B, L, H, Dv)`` contiguous, one dtype; g ``(B, L, H)`` float32 or None (no decay).
    Returns ``(B, L, H, Dv)`` in v's dtype. Gated calls that need gradients where fla's own backward is
    refused take them from fla's forward kernel (``_GLAFromForwardKernels``)."""
    if g is not None and needs_grad(q, k, v, g) and fla_backward_refused(q):
        return _GLAFromForwardKernels.apply(q, k, v, g)
    return _kernel(q, k, v, g)


def _to_fla_layout(x: Tensor) -> Tensor:
    """``(B, H, L, D)`` -> contiguous ``(B, L, H, D')``, D' the next multiple of ALIGN: one copy."""
    x = x.transpose(1, 2)
    pad = -x.shape[-1] % ALIGN
    return (F.pad(x, (0, pad)) if pad else x).contiguous()


@eager_under_compile
def fla_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor], log_a_bwd: Optional[Tensor],
                  causal: bool) -> Tensor:
    """``o = ((q k^T) * M) v`` with LION's mask ``M`` (``lion_attention``'s), both directions on fla's kernels.

    q, k: ``(B, H, L, Dk)``; v: ``(B, H, L, Dv)`` (the normaliser as its last column if wanted), all in one
    dtype of ``FLA_DTYPES`` (``lion_attention`` passes float32, see the module's docstring); log-gates
    ``(B, H, L)`` ``<= 0`` or None (gate 1). Returns ``(B, H, L, Dv)`` in float32 (or the inputs' wider
    dtype), the two directions summed in that precision. Differentiable in every tensor input, once."""
    Dv = v.shape[-1]
    acc = torch.promote_types(v.dtype, torch.float32)
    q, k, v = (_to_fla_layout(x) for x in (q, k, v))  # everything below is (B, L, H, ...)
    f = log_a_fwd.to(acc).transpose(1, 2).contiguous() if log_a_fwd is not None else None  # float32 gates
    # forward direction, diagonal included: fla's recurrence with g = log f is M_ij = f_{j+1} ... f_i (i >= j)
    out = _gla(q, k, v, f).to(acc)
    if not causal:
        # Backward direction: o_i = sum_{j > i} (b_i ... b_{j-1}) (q_i . k_j) v_j, diagonal excluded. Index the
        # keys by p = j - 1 >= i and fold the gate b_p into them: with k~_p = b_p k_{p+1}, v~_p = v_{p+1}
        # (zero at p = L - 1),
        #     o_i = sum_{p >= i} (b_i ... b_{p-1}) (q_i . k~_p) v~_p,
        # the inclusive reversed scan S_i = b_i S_{i+1} + k~_i v~_i^T, o_i = q_i S_i: fla's recurrence on
        # everything flipped along L with g = flip(log b). The diagonal term never enters (no subtraction of
        # q_i . k_i v_i, which would cancel in bf16), and b_p <= 1 so k~ is no larger than k. b_{L-1} meets
        # only zeros, as in M.
        b = log_a_bwd.to(acc).transpose(1, 2).contiguous() if log_a_bwd is not None else None
        k_next = F.pad(k[:, 1:], (0, 0, 0, 0, 0, 1))
        v_next = F.pad(v[:, 1:], (0, 0, 0, 0, 0, 1))
        if b is not None:  # the product in float32, rounded once to k's dtype
            k_next = (k_next.to(acc) * b.exp()[..., None]).to(k.dtype)
        back = _gla(q.flip(1), k_next.flip(1), v_next.flip(1), b.flip(1) if b is not None else None)
        out = out + back.flip(1).to(acc)
    out = out.transpose(1, 2)[..., :Dv]
    if not out.requires_grad:
        return out
    # fla's own backward gives no graph of itself under create_graph=True: a gradient of out meets this first
    return guard_first_derivatives(out, "flash-linear-attention's kernels (the chunk form)")
