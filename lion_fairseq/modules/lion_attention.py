"""LionAttention: projections, feature map and decay gates around ``lion_fairseq.ops``, in fairseq's
``T x B x C`` layout, with incremental (recurrent) decoding state."""
import functools
import logging
import math
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from ..ops import (FORMS, block_attention, causal_state, is_chunk_size, lion_attention, lion_step, state_after,
                   state_before)
from ..ops.float32 import autocast_enabled, float32_math
from ..ops.padding import bool_padding_mask
from ..ops.recurrent import decayed
from .feature_maps import FEATURE_MAPS, SIGNED_FEATURE_MAPS

logger = logging.getLogger(__name__)

VARIANTS = ("lit", "d", "s")
DEFAULT_FEATURE_MAP = {"lit": "elu", "d": "silu_norm", "s": "silu_norm"}
# fairseq's incremental state: {module key: {name: tensor}}
IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


def check_lion_options(variant: str, form: str, chunk_size: int, feature_map: str, normalize: bool,
                       gate_temperature: float = 1.0, short_conv: int = 0, causal: Optional[bool] = None) -> None:
    """Raise ValueError naming the command-line option for a bad combination (``causal`` None: the
    direction is not known yet, checks that depend on it wait for the module)."""
    if variant not in VARIANTS:
        retnet = " (LION-RETNET is 'd')" if "retnet" in str(variant).lower() or str(variant) == "D" else ""
        raise ValueError(f"variant (--lion-variant) must be one of {VARIANTS}{retnet}; got {variant!r}")
    if form not in FORMS:
        raise ValueError(f"--lion-form must be one of {FORMS}; got {form!r}")
    if not is_chunk_size(chunk_size):
        raise ValueError(f"--lion-chunk-size must be an integer >= 1; got {chunk_size!r}")
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"--lion-feature-map must be one of {tuple(FEATURE_MAPS)}; got {feature_map!r}")
    if normalize and feature_map in SIGNED_FEATURE_MAPS:
        raise ValueError(f"--lion-feature-map {feature_map} gives scores of either sign, so the row "
                         "normaliser can divide by zero: add --no-lion-normalize (and usually "
                         "--lion-norm-after), or pick --lion-feature-map elu or silu_norm")
    if isinstance(gate_temperature, bool) or not isinstance(gate_temperature, (int, float)) \
            or not 0 < gate_temperature < math.inf:  # an infinite one makes every decay 1: LION-LIT
        raise ValueError(f"--lion-gate-temperature must be a finite number > 0; got {gate_temperature!r}")
    if variant == "lit" and gate_temperature != 1:
        raise ValueError("--lion-gate-temperature scales the decay gates; LION-LIT (--lion-variant lit) has none: "
                         "leave it out, or pick a LION-D or LION-S arch")
    if isinstance(short_conv, bool) or not isinstance(short_conv, int) or short_conv < 0 or short_conv == 1:
        raise ValueError(f"--lion-short-conv must be 0 (off) or a kernel width >= 2; got {short_conv!r}")
    if causal is False and short_conv and short_conv % 2 == 0:
        raise ValueError(f"--lion-short-conv {short_conv}: a bidirectional model's convolution is centred on "
                         "each token, so its width must be odd (e.g. 3 or 5)")


@float32_math
def float32_linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """``layer(x)`` in float32 whatever the dtypes of ``x`` and the weights (and under autocast): the gate
    logits, which every later position's decay compounds."""
    bias = layer.bias.float() if layer.bias is not None else None
    return F.linear(x.float(), layer.weight.float(), bias)


def linear_input(x: Tensor, layer: nn.Linear) -> Tensor:
    """``x`` in the dtype that ``layer`` multiplies in: its weights', or as it is where autocast is on
    for x's device (autocast casts it there, and a cast here would be a full-size round trip, as from
    16 bits to float32 and back under ``--amp``)."""
    return x if autocast_enabled(x.device.type) else x.to(layer.weight.dtype)


def checked_input(x: Tensor, key_padding_mask: Optional[Tensor], embed_dim: int) -> Optional[Tensor]:
    """Check an attention module's input ``x`` ``(T, B, C)`` and its ``key_padding_mask`` ``(B, T)``, one
    column per token of this call (also when decoding: not the whole prefix); returns the mask as bool."""
    if x.dim() != 3:
        raise ValueError(f"x must be (T, B, C), fairseq's time-first layout; got shape {tuple(x.shape)}")
    T, B, C = x.shape
    if C != embed_dim:
        raise ValueError(f"input has {C} channels; this attention was built for {embed_dim}")
    if key_padding_mask is None:
        return None
    if key_padding_mask.shape != (B, T):
        raise ValueError(f"key_padding_mask must be (B, T) = {(B, T)} for x of shape (T, B, C) = {(T, B, C)}, a "
                         f"column per token of this call (one when decoding a token); "
                         f"got {tuple(key_padding_mask.shape)}")
    return bool_padding_mask(key_padding_mask)


def head_layer_norm(y: Tensor, norm: nn.LayerNorm) -> Tensor:
    """``--lion-norm-after``: ``norm`` over each head's output y ``(B, H, T, D)``, in float32 at least, as y
    may be an unnormalised sum that only float32's range holds."""
    dtype = torch.promote_types(y.dtype, torch.float32)
    return F.layer_norm(y.to(dtype), norm.normalized_shape, norm.weight.to(dtype), norm.bias.to(dtype), norm.eps)


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """``(T, B, H * D)`` -> ``(B, H, T, D)``, a view of fairseq's layout in the operator's."""
    T, B, C = x.shape
    return x.view(T, B, num_heads, C // num_heads).permute(1, 2, 0, 3)


@with_incremental_state
class LionAttention(nn.Module):
    """LION multi-head attention. ``forward(x)`` maps ``x`` ``(T, B, C)`` to ``(T, B, C)``.

    variant: ``"lit"`` (no decay), ``"d"`` (one learned decay per head) or ``"s"`` (a decay computed from
    each token by a ``Linear(C, H)``). The decay between key j and query i is the product of the gates
    ``lambda_j ... lambda_{i-1}`` (i > j) or ``lambda_{i+1} ... lambda_j`` (i < j).
    """

    def __init__(self, embed_dim: int, num_heads: int, variant: str = "s", *, form: str = "chunk",
                 chunk_size: int = 64, feature_map: Optional[str] = None, normalize: bool = True,
                 norm_after: bool = False, gate_temperature: float = 1.0, output_gate: bool = False,
                 short_conv: int = 0, causal: bool = False, bias: bool = True, eps: float = 1e-6):
        super().__init__()
        feature_map = feature_map or DEFAULT_FEATURE_MAP.get(variant, "elu")
        check_lion_options(variant, form, chunk_size, feature_map, normalize, gate_temperature, short_conv, causal)
        if embed_dim % num_heads:
            raise ValueError(f"embedding dim {embed_dim} must be divisible by the number of attention heads {num_heads}")
        if normalize and not eps > 0:  # a row whose keys are all padding sums to 0
            raise ValueError(f"eps must be > 0 with the row normaliser (normalize=True); got {eps!r}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.variant, self.form, self.chunk_size = variant, form, chunk_size
        self.phi = FEATURE_MAPS[feature_map]
        self.normalize, self.causal, self.eps = normalize, causal, eps
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        if variant == "d":
            self.gate_logit = nn.Parameter(torch.randn(num_heads))
        elif variant == "s":
            self.gate_proj = nn.Linear(embed_dim, num_heads)
        # the released MLM recipe's LayerNorm over each head's output
        self.head_norm = nn.LayerNorm(self.head_dim) if norm_after else None
        # GLA's logsigmoid(x) / tau: a temperature > 1 pulls every gate towards 1 (longer memories)
        self.gate_temperature = float(gate_temperature)
        # GLA / RetNet output gate: swish(W_g x) times the (normalised) head outputs
        self.out_gate = nn.Linear(embed_dim, embed_dim, bias=bias) if output_gate else None
        # depthwise convolution of width N over the projected q, k, v (causal: the token and the N-1
        # before it; bidirectional: centred), one tap per channel and offset, no bias: (N, 3C)
        self.short_conv = short_conv
        self.conv_weight = nn.Parameter(torch.zeros(short_conv, 3 * embed_dim)) if short_conv else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=2 ** -0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.conv_weight is not None:  # the identity: the convolution starts as the paper's model
            with torch.no_grad():
                self.conv_weight.zero_()
                self.conv_weight[self._conv_centre()] = 1.0

    def _conv_centre(self) -> int:
        """The tap of the token itself: the last one (causal) or the middle one (bidirectional)."""
        return self.short_conv - 1 if self.causal else (self.short_conv - 1) // 2

    def log_gates(self, x: Tensor) -> Optional[Tensor]:
        """``log lambda`` in float32: ``(B, H, T)`` for ``s``, ``(H, 1)`` for ``d``, None for ``lit``.
        ``x``: ``(T, B, C)``. logsigmoid keeps it finite (no ``log(1 - sigmoid)``) and differentiable."""
        if self.variant == "d":
            logits = self.gate_logit.float()
            self._check_finite(logits, "its learned gate logits (gate_logit parameter)")
            return F.logsigmoid(logits)[:, None] / self.gate_temperature
        if self.variant == "s":
            logits = float32_linear(self.gate_proj, x)
            self._check_finite(logits, "the gate logits gate_proj(x) (the hidden states x, or gate_proj's weights)")
            return (F.logsigmoid(logits) / self.gate_temperature).permute(1, 2, 0)
        return None

    def _check_finite(self, logits: Tensor, what: str) -> None:
        """At inference, a NaN/inf gate would spread to every later position through the state: report it
        (one reduction and one host sync per call). In training the check is not made: a non-finite value
        reaches the loss and the gradients, where fairseq's loss scaler skips the step (--fp16, --amp) or
        its NaN detector reports it, on every rank alike; and training makes no host sync here."""
        if self.training:
            return
        if not bool(torch.isfinite(logits).all()):
            bad = int((~torch.isfinite(logits)).sum())
            raise FloatingPointError(
                f"LION-{self.variant.upper()} attention: {bad} of {logits.numel()} values of {what} are NaN or inf. "
                "The input or the weights are already broken: check the data and the previous layer, or lower "
                "--lr / clip gradients (--clip-norm); in fp16 use loss scaling or train in bf16")

    def _keys_values(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Feature-mapped keys and values, ``(B, H, T, D)`` each, of ``x`` ``(T, B, C)`` (without
        ``--lion-short-conv``; with it, :meth:`_qkv`)."""
        return self.phi(self._heads(self.k_proj(x))), self._heads(self.v_proj(x))

    def _qkv(self, x: Tensor, key_padding_mask: Optional[Tensor], incremental_state=None,
             rows: Optional[Tuple[int, int]] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """Feature-mapped queries and keys and the values, ``(B, H, T', D)`` each, of ``x`` ``(T, B, C)``;
        key_padding_mask ``(B, T)``.

        With ``--lion-short-conv`` the projections are convolved first; padded positions count as zeros
        (as the sequence's own ends do), so padding changes nothing for the real tokens.
        ``rows=(a, b)`` (blockwise inference): ``x`` is a block with its neighbours on each side (or the
        sequence's ends), keep rows a..b-1, ``T' = b - a``; otherwise ``T' = T``."""
        if self.conv_weight is None:
            q = self.phi(self._heads(self.q_proj(x)))
            k, v = self._keys_values(x)
            return q, k, v
        u = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (T, B, 3C)
        if key_padding_mask is not None:
            u = u.masked_fill(key_padding_mask.t()[..., None], 0)
        u = self._convolve(u, key_padding_mask, incremental_state, rows)
        q, k, v = u.split(self.embed_dim, dim=-1)
        return self.phi(self._heads(q)), self.phi(self._heads(k)), self._heads(v)

    def _convolve(self, u: Tensor, key_padding_mask: Optional[Tensor], incremental_state,
                  rows: Optional[Tuple[int, int]]) -> Tensor:
        """The depthwise convolution of ``u`` ``(T, B, 3C)`` (padding already zero) along T."""
        N, T = self.short_conv, u.shape[0]
        w = self.conv_weight.to(u.dtype)
        left = self._conv_centre()
        if rows is not None:  # blockwise: the block's neighbours are in u; zeros past the sequence's ends
            a, b = rows
            pad_left, pad_right = max(left - a, 0), max(b + (N - 1 - left) - T, 0)
            ext = F.pad(u, (0, 0, 0, 0, pad_left, pad_right))
            start = a + pad_left - left
            return sum(w[i] * ext[start + i:start + i + b - a] for i in range(N))
        if not self.causal:
            ext = F.pad(u, (0, 0, 0, 0, left, N - 1 - left))
            return sum(w[i] * ext[i:i + T] for i in range(N))
        saved = self.get_incremental_state(incremental_state, "lion_conv") if incremental_state is not None else None
        if saved:  # decoding steps: the last N-1 inputs are cached; a padded token leaves them as they were
            cache = saved["conv"].transpose(0, 1)  # (N-1, B, 3C)
            out = []
            for t in range(T):
                ext = torch.cat([cache, u[t:t + 1]], dim=0)
                out.append(sum(w[i] * ext[i] for i in range(N)))
                new = ext[1:]
                if key_padding_mask is not None:
                    new = torch.where(key_padding_mask[:, t][None, :, None], cache, new)
                cache = new
            y = torch.stack(out, dim=0)
        else:
            ext = F.pad(u, (0, 0, 0, 0, N - 1, 0))
            y = sum(w[i] * ext[i:i + T] for i in range(N))
            if incremental_state is not None:  # prefill: cache each row's last N-1 real inputs
                cache = self._last_real_rows(ext, key_padding_mask)
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "lion_conv", {"conv": cache.transpose(0, 1)})
        return y

    def _last_real_rows(self, ext: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        """The last N-1 rows of ``ext`` ``(N-1+T, B, 3C)`` (N-1 zero rows, then the prompt) that are not
        padding, per sentence: ``(N-1, B, 3C)``."""
        n = self.short_conv - 1
        if key_padding_mask is None:
            return ext[-n:]
        real = torch.cat([key_padding_mask.new_ones(n, key_padding_mask.shape[0]), ~key_padding_mask.t()], 0)
        count = real.long().cumsum(0)  # (N-1+T, B): real rows up to here
        total = count[-1]
        idx = torch.stack([((count == total - n + 1 + j) & real).long().argmax(0) for j in range(n)])  # (N-1, B)
        return ext.gather(0, idx[..., None].expand(-1, -1, ext.shape[-1]))

    def _heads(self, x: Tensor) -> Tensor:
        return split_heads(x, self.num_heads)

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[IncrementalState] = None) -> Tensor:
        """x: ``(T, B, C)``; key_padding_mask: ``(B, T)`` bool, True at padding. Returns ``(T, B, C)``.

        With ``incremental_state`` (causal decoding) the module keeps only ``S`` ``(B, H, D, D)`` and
        ``z`` ``(B, H, D)``: a first call with T tokens prefills them in one pass, later calls advance the
        recurrence token by token.
        """
        key_padding_mask = checked_input(x, key_padding_mask, self.embed_dim)  # read by the convolution and decoding
        q, k, v = self._qkv(x, key_padding_mask, incremental_state)
        if not self.normalize and v.dtype == torch.float16:
            v = v.float()  # an unnormalised sum over T keys can pass fp16's 65504: the output stays float32
        log_lam = self.log_gates(x)
        if incremental_state is not None:
            if not self.causal:
                raise ValueError("incremental decoding needs a causal LionAttention")
            y = self._decode(q, k, v, log_lam, key_padding_mask, incremental_state)
        else:
            fwd, bwd = self._directional_gates(log_lam)
            y = lion_attention(q, k, v, fwd, bwd, form=self.form, causal=self.causal, normalize=self.normalize,
                               key_padding_mask=key_padding_mask, chunk_size=self.chunk_size, eps=self.eps)
        return self._output(y, x)

    def _directional_gates(self, log_lam: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Operator gates from per-position ``log lambda``: ``log_a_fwd[t] = log lambda_{t-1}`` and
        ``log_a_bwd[t] = log lambda_{t+1}`` (0 at the ends, where they lie on no path)."""
        if log_lam is None or self.variant == "d":
            return log_lam, log_lam
        return F.pad(log_lam[..., :-1], (1, 0)), F.pad(log_lam[..., 1:], (0, 1))

    def _output(self, y: Tensor, x: Tensor) -> Tensor:
        """Head outputs ``y`` ``(B, H, T, D)`` of the input ``x`` ``(T, B, C)`` -> ``(T, B, C)`` (``x`` is
        read by the output gate only)."""
        if self.head_norm is not None:
            y = head_layer_norm(y, self.head_norm)
        B, H, T, D = y.shape
        y = linear_input(y.permute(2, 0, 1, 3).reshape(T, B, H * D), self.out_proj)
        if self.out_gate is not None:
            y = y * F.silu(self.out_gate(x)).to(y.dtype)
        return self.out_proj(y)

    def decoding_state(self, incremental_state: Optional[IncrementalState]) -> Dict[str, Tensor]:
        """The ``(S, z)`` the last prefill or decoding step saved (``{"S", "z"}``), ``{}`` before the first."""
        return (self.get_incremental_state(incremental_state, "lion_state") or {}) if incremental_state else {}

    def _decode(self, q: Tensor, k: Tensor, v: Tensor, log_lam: Optional[Tensor],
                key_padding_mask: Optional[Tensor], incremental_state) -> Tensor:
        B, H, T, _ = q.shape
        saved = self.decoding_state(incremental_state)
        lam = log_lam.expand(B, H, T) if log_lam is not None else None
        # the state is kept as the next token reads it, with the last token's own gate applied
        # (log_a_fwd[t] = log lambda_{t-1}): (S, z) is all there is, and a step adds its key to it
        if "S" not in saved:  # prefill: the causal form over the prompt, then its final state in one pass
            fwd, _ = self._directional_gates(log_lam)
            y = lion_attention(q, k, v, fwd, None, form=self.form, causal=True, normalize=self.normalize,
                               key_padding_mask=key_padding_mask, chunk_size=self.chunk_size, eps=self.eps)
            S, z = causal_state(k, v, fwd, key_padding_mask)
            if lam is not None:  # the gate of each row's last real token (a right-padded prompt ends in pads)
                last = torch.full((B,), T - 1, dtype=torch.long, device=q.device)
                if key_padding_mask is not None:
                    last = last - (~key_padding_mask).flip(-1).int().argmax(-1)
                S, z = decayed(S, z, lam.gather(-1, last[:, None, None].expand(B, H, 1)).squeeze(-1))
        else:
            S, z = saved["S"], saved["z"]
            ys = []
            for t in range(T):
                y_t, (S_t, z_t) = lion_step(q[:, :, t], k[:, :, t], v[:, :, t], None, (S, z),
                                            normalize=self.normalize, eps=self.eps)
                ys.append(y_t)
                if lam is not None:
                    S_t, z_t = decayed(S_t, z_t, lam[..., t])
                if key_padding_mask is not None:  # a padded token leaves the state as it was
                    pad = key_padding_mask[:, t]
                    S_t = torch.where(pad[:, None, None, None], S, S_t)
                    z_t = torch.where(pad[:, None, None], z, z_t)
                S, z = S_t, z_t
            y = torch.stack(ys, dim=2)
        new = {"S": S, "z": z}
        self.set_incremental_state(incremental_state, "lion_state", new)
        return y

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor) -> None:
        """Select beams: ``new_order`` ``(B',)`` indexes the batch, the first dim of every saved tensor."""
        for key in ("lion_state", "lion_conv"):
            saved = self.get_incremental_state(incremental_state, key)
            if saved:
                saved = {name: t.index_select(0, new_order) for name, t in saved.items()}
                self.set_incremental_state(incremental_state, key, saved)

    # whether ``blockwise`` computes this module's ``forward`` (a subclass that mixes differently says no)
    streams_blockwise = True

    def blockwise(self, source: Callable[[int, int], Tensor], T: int, key_padding_mask: Optional[Tensor],
                  block: int) -> Iterator[Tuple[int, int, Tensor]]:
        """Bidirectional inference a block of tokens at a time: yields ``(s, e, out)`` from left to right,
        ``out`` ``(e - s, B, C)`` the rows s..e-1 of ``forward``'s output, for an input whose rows
        ``source(s, e)`` gives (so the caller never holds the whole of it, nor its projections).

        A first pass, right to left, leaves the backward direction's state at each block's edge; the
        second computes each block with both states carried in (inside the block, the chunk form). Each
        block's keys and values are projected in both passes: a sixth more multiply-adds than ``forward``
        for memory that does not grow with T beyond one state per block. key_padding_mask: ``(B, T)``
        bool, True at padding."""
        if self.causal:
            raise ValueError("blockwise inference is for bidirectional LionAttention")
        _log_blockwise(block)
        edges = list(range(0, T, block)) + [T]
        n = len(edges) - 1
        mask = (lambda s, e: key_padding_mask[:, s:e]) if key_padding_mask is not None else (lambda s, e: None)
        lam: Optional[Tensor] = None  # LION-S: log lambda of every token, (B, H, T), filled right to left
        head_gate: Optional[Tensor] = None  # LION-D: one log-gate per head, the same in every block

        def gates(s: int, e: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
            """log_a_fwd[t] = log lambda_{t-1}, log_a_bwd[t] = log lambda_{t+1}, 0 past the ends."""
            if lam is None:
                return head_gate, head_gate
            return (F.pad(lam[..., max(s - 1, 0):e - 1], (int(s == 0), 0)),
                    F.pad(lam[..., s + 1:e + 1], (0, int(e == T))))

        # --lion-short-conv: a block's projections also need its neighbours' inputs (overlapping blocks)
        left_halo = self._conv_centre() if self.short_conv else 0
        right_halo = self.short_conv - 1 - left_halo if self.short_conv else 0

        def block_qkv(s: int, e: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
            """The block's input ``(e - s, B, C)`` and its q, k, v ``(B, H, e - s, D)``."""
            if not self.short_conv:
                x = source(s, e)
                return (x,) + self._qkv(x, mask(s, e))
            a, b = max(s - left_halo, 0), min(e + right_halo, T)
            x = source(a, b)
            q, k, v = self._qkv(x, mask(a, b), rows=(s - a, e - a))
            return (x[s - a:e - a], q, k, v)

        rights, right = [None] * n, None
        for i in reversed(range(n)):
            rights[i] = right
            s, e = edges[i], edges[i + 1]
            if self.short_conv and i > 0:
                x, _, k, v = block_qkv(s, e)
            else:
                x = source(s, e)
            log_lam = self.log_gates(x)
            if self.variant == "s":
                if lam is None:
                    lam = log_lam.new_zeros(log_lam.shape[:2] + (T,))
                lam[..., s:e] = log_lam
            else:
                head_gate = log_lam
            if i > 0:  # the first block's right state is read by no block
                if not self.short_conv:
                    k, v = self._keys_values(x)
                right = state_before(right, k, v, gates(s, e)[1], mask(s, e))
        left = None
        for i in range(n):
            s, e = edges[i], edges[i + 1]
            x, q, k, v = block_qkv(s, e)
            f, b = gates(s, e)
            # inside a block the chunk form, whatever self.form: the same function as the token loop, at
            # the chunk form's speed, in memory that still grows with the block, not with T
            y = block_attention(q, k, v, f, b, left, rights[i], form="chunk", normalize=self.normalize,
                                key_padding_mask=mask(s, e), chunk_size=self.chunk_size, eps=self.eps)
            if i + 1 < n:
                left = state_after(left, k, v, f, mask(s, e))
            yield s, e, self._output(y, x)


@functools.lru_cache(maxsize=None)
def _log_blockwise(block: int) -> None:
    """Once per process: the ops' own log line names the chunk form that runs inside each block, which
    alone reads as if a ``--model-overrides`` to the recurrent form had been ignored."""
    logger.info(f"LION attention: recurrent form at inference, blockwise: blocks of {block} tokens, each "
                "direction's state carried from block to block (inside a block, the chunk form)")
