"""``lion_attention``: argument checks and the choice of form. The math lives in the form modules."""
import functools
import logging
import numbers
from typing import Optional

import torch
from torch import Tensor

from .backend import BACKENDS, chunk_backend, fall_back_from_triton
from .chunk import chunk_attention
from .compiling import compiling
from .float32 import accumulation_dtype, check_eps, check_float, float32_math, needs_grad
from .gates import LOG_GATE_MIN, check_gate
from .padding import checked_padding_mask, mask_padded_keys
from .fla import fla_attention, fla_available, fla_unavailable
from .parallel import parallel_attention
from .recurrent import recurrent_attention

FORMS = ("parallel", "chunk", "recurrent")

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _log_what_runs(form: str, chunk_size: int, backend: str, device: str, dtype: torch.dtype) -> None:
    """One log line per combination that runs in this process: what a run's log cannot otherwise show
    (which backend the chunk form fell to, and the form a ``--model-overrides`` switched to)."""
    # the GPU kernels pick their own chunks: chunk_size is the torch backend's
    chunks = f"chunks of {chunk_size}" if backend == "torch" else f"{backend}'s own chunks, not --lion-chunk-size's"
    how = f"chunk form ({chunks}) on {backend}" if form == "chunk" else f"{form} form"
    logger.info(f"LION attention: {how}, {device}, {str(dtype).replace('torch.', '')} inputs")


def _gate(log_a: Optional[Tensor], L: int, dtype: torch.dtype, expand: bool = True) -> Optional[Tensor]:
    """A log-gate whose shape ``lion_attention`` checked as ``(b, h, L)`` with b in {1, B}, h in {1, H}
    (``(b, h, l)`` with l in {1, L} unless ``expand``), or None."""
    if log_a is None:
        return None
    a = log_a.to(dtype).clamp(min=LOG_GATE_MIN)
    while a.dim() < 3:
        a = a.unsqueeze(0)
    return a.expand(a.shape[0], a.shape[1], L) if expand else a


def is_chunk_size(chunk_size: object) -> bool:
    """An integer >= 1, of any integer type (numpy's, say); not bool, which is one."""
    return isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool) and chunk_size >= 1


@float32_math
def lion_attention(q: Tensor, k: Tensor, v: Tensor, log_a_fwd: Optional[Tensor] = None,
                   log_a_bwd: Optional[Tensor] = None, *, form: str = "parallel", causal: bool = False,
                   normalize: bool = True, key_padding_mask: Optional[Tensor] = None, chunk_size: int = 64,
                   eps: float = 1e-6, matmul_dtype: Optional[torch.dtype] = None,
                   backend: Optional[str] = None) -> Tensor:
    """LION attention ``y = norm((q k^T) * M) v`` with the decay mask ``M`` of the log-gates.

    Args:
        q, k: ``(B, H, L, Dk)``, already feature-mapped. v: ``(B, H, L, Dv)``. Floating-point tensors.
        log_a_fwd, log_a_bwd: float log-gates ``<= 0``, ``(B, H, L)`` or broadcastable (``(H, 1)`` is one
            gate per head); ``None`` means gate 1. ``M_ij = f_{j+1}...f_i`` for ``i > j``, ``M_ii = 1``,
            ``M_ij = b_i...b_{j-1}`` for ``i < j`` (0 when ``causal``; ``log_a_bwd`` is then ignored).
        form: ``"parallel"`` (L x L matrix), ``"chunk"`` (chunkwise state passing) or ``"recurrent"``
            (two RNN scans); all three compute the same function.
        backend: what runs the chunk form: ``"triton"`` (LION's own fused kernel, ``ops/kernel.py``: CUDA,
            or CPU tensors under ``TRITON_INTERPRET=1``), ``"fla"`` (flash-linear-attention's kernels,
            ``ops/fla.py``: CUDA) or ``"torch"`` (the PyTorch chunk form). None: the environment variable
            ``LION_BACKEND``, else fla on CUDA when it is installed (``LION_FLA=0`` turns that off) and
            PyTorch otherwise. A backend that cannot run says why once and falls back (``ops/backend.py``).
        normalize: divide each row by ``sum_j A_ij + eps`` (eps: a finite number >= 0).
        key_padding_mask: ``(B, L)`` bool, True at keys that must contribute nothing (an integer mask,
            nonzero there, is taken too).
        chunk_size: tokens per chunk of the chunk form.
        matmul_dtype: ``torch.bfloat16`` runs the PyTorch chunk form's matmuls in bfloat16 (AMX on a
            CPU that has it) with the outputs, states, decays and normalisers kept in float32, when no
            gradient is needed (inference); otherwise, and by default, every product is float32. On
            the CPUs measured so far it is no faster (its matmuls get faster, rounding their operands
            and results costs as much; see ``benchmark.operator``'s ``chunk_bf16``), so the layers
            leave it off.
    Returns:
        ``(B, H, L, Dv)`` in ``v.dtype``; computed in float32 (float64 for float64 inputs) whatever the
        input dtype, with autocast off (fairseq's ``--amp``), on fla too; only ``matmul_dtype`` asks for
        bfloat16 products.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}; got {form!r}")
    if not is_chunk_size(chunk_size):
        raise ValueError(f"chunk_size must be an integer >= 1; got {chunk_size!r}")
    chunk_size = int(chunk_size)
    check_eps(eps)
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H, L, Dk); got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}; got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, H, L, Dv) with q's (B, H, L) = {tuple(q.shape[:3])}; got {tuple(v.shape)}")
    check_float(q=q, k=k, v=v)
    B, H, L, _ = q.shape
    if key_padding_mask is not None:
        key_padding_mask = checked_padding_mask(key_padding_mask, B, L)
    for log_a, name in ((log_a_fwd, "log_a_fwd"), (log_a_bwd, "log_a_bwd")):  # log_a_bwd too where causal ignores it
        if log_a is not None:
            check_gate(log_a, name, (B, H, L))

    if matmul_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"matmul_dtype must be None, torch.float32 or torch.bfloat16; got {matmul_dtype!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}; got {backend!r}")
    dtype = accumulation_dtype(v)
    out_dtype = v.dtype
    if 0 in (B, H, L, q.shape[-1], v.shape[-1]):  # nothing to attend to, or nothing to read: y = 0
        return v * 0
    # the kernel reads q, k and v in the one dtype they promote to: that dtype decides whether it can run
    common = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    probe = v if v.dtype == common else v.new_empty(0, dtype=common)
    which = chunk_backend(backend, probe, (q.shape[-1], v.shape[-1]), fla_available, fla_unavailable) \
        if form == "chunk" else "torch"
    if not compiling():  # a log call would break TorchDynamo's graph
        _log_what_runs(form, chunk_size, which, v.device.type, v.dtype)
    if which == "triton":
        from .kernel import OutOfResources, does_not_fit, kernel_attention

        f, b = (_gate(g, L, torch.float32, expand=False) for g in (log_a_fwd, log_a_bwd))
        try:
            y = kernel_attention(q.to(common), k.to(common), v.to(common), f, b, causal, normalize,
                                 key_padding_mask, eps, chunk_size)
            return y.to(out_dtype)
        except OutOfResources as e:  # known only as Triton loads the kernel onto this GPU, before it runs
            which = fall_back_from_triton(probe, does_not_fit(probe, (q.shape[-1], v.shape[-1]), e), fla_available)
    use_fla = which == "fla"
    # bfloat16 products only where they pay and nothing is trained through them
    low = (matmul_dtype == torch.bfloat16 and form == "chunk" and not use_fla and dtype == torch.float32
           and not needs_grad(q, k, v, log_a_fwd, log_a_bwd))
    mm = torch.bfloat16 if low else dtype
    q, k, v = q.to(mm), k.to(mm), v.to(mm)
    k, v = mask_padded_keys(k, v, key_padding_mask)
    if causal:
        log_a_bwd = None

    if form == "parallel":
        f = _gate(log_a_fwd, L, torch.float64)
        b = _gate(log_a_bwd, L, torch.float64)
        num, den = parallel_attention(q, k, v, f, b, causal)
    elif form == "chunk" and not use_fla:  # normalises block by block itself; takes one gate per head as such
        f = _gate(log_a_fwd, L, dtype, expand=False)
        b = _gate(log_a_bwd, L, dtype, expand=False)
        return chunk_attention(q, k, v, f, b, causal, chunk_size, normalize, eps).to(out_dtype)
    else:
        f = _gate(log_a_fwd, L, dtype)
        b = _gate(log_a_bwd, L, dtype)
        f = f.expand(B, H, L).contiguous() if f is not None else None
        b = b.expand(B, H, L).contiguous() if b is not None else None
        if normalize:  # the normaliser rides along as a column of ones in v
            v = torch.cat([v, v.new_ones(B, H, L, 1)], dim=-1)
        if use_fla:
            out = fla_attention(q, k, v, f, b, causal)
        else:
            out = recurrent_attention(q, k, v, f, b, causal)
        num, den = (out[..., :-1], out[..., -1]) if normalize else (out, None)
    y = num / (den[..., None] + eps) if normalize else num
    return y.to(out_dtype)
