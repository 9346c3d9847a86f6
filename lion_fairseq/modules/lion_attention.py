"""LionAttention: projections, feature map and decay gates around ``lion_fairseq.ops``, in fairseq's
``T x B x C`` layout, with incremental (recurrent) decoding state."""
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from ..ops import FORMS, block_attention, causal_state, lion_attention, lion_step, state_after, state_before
from ..ops.float32 import float32_math
from .feature_maps import FEATURE_MAPS, SIGNED_FEATURE_MAPS

VARIANTS = ("lit", "d", "s")
DEFAULT_FEATURE_MAP = {"lit": "elu", "d": "silu_norm", "s": "silu_norm"}


def check_lion_options(variant: str, form: str, chunk_size: int, feature_map: str, normalize: bool) -> None:
    """Raise ValueError naming the command-line option for a bad combination."""
    if variant not in VARIANTS:
        raise ValueError(f"--lion-variant must be one of {VARIANTS}; got {variant!r}")
    if form not in FORMS:
        raise ValueError(f"--lion-form must be one of {FORMS}; got {form!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"--lion-chunk-size must be an integer >= 1; got {chunk_size!r}")
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"--lion-feature-map must be one of {tuple(FEATURE_MAPS)}; got {feature_map!r}")
    if normalize and feature_map in SIGNED_FEATURE_MAPS:
        raise ValueError(f"--lion-feature-map {feature_map} gives scores of either sign, so the row "
                         "normaliser can divide by zero: add --no-lion-normalize (and usually "
                         "--lion-norm-after), or pick --lion-feature-map elu or silu_norm")


@float32_math
def float32_linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """``layer(x)`` in float32 whatever the dtypes of ``x`` and the weights (and under autocast): the gate
    logits, which every later position's decay compounds."""
    bias = layer.bias.float() if layer.bias is not None else None
    return F.linear(x.float(), layer.weight.float(), bias)


@with_incremental_state
class LionAttention(nn.Module):
    """LION multi-head attention. ``forward(x)`` maps ``x`` ``(T, B, C)`` to ``(T, B, C)``.

    variant: ``"lit"`` (no decay), ``"d"`` (one learned decay per head) or ``"s"`` (a decay computed from
    each token by a ``Linear(C, H)``). The decay between key j and query i is the product of the gates
    ``lambda_j ... lambda_{i-1}`` (i > j) or ``lambda_{i+1} ... lambda_j`` (i < j).
    """

    def __init__(self, embed_dim: int, num_heads: int, variant: str = "s", *, form: str = "chunk",
                 chunk_size: int = 64, feature_map: Optional[str] = None, normalize: bool = True,
                 norm_after: bool = False, causal: bool = False, bias: bool = True, eps: float = 1e-6):
        super().__init__()
        feature_map = feature_map or DEFAULT_FEATURE_MAP.get(variant, "elu")
        check_lion_options(variant, form, chunk_size, feature_map, normalize)
        if embed_dim % num_heads:
            raise ValueError(f"embedding dim {embed_dim} must be divisible by the number of attention heads {num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.variant, self.form, self.chunk_size = variant, form, chunk_size
        self.feature_map_name, self.phi = feature_map, FEATURE_MAPS[feature_map]
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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=2 ** -0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    def log_gates(self, x: Tensor) -> Optional[Tensor]:
        """``log lambda`` in float32: ``(B, H, T)`` for ``s``, ``(H, 1)`` for ``d``, None for ``lit``.
        ``x``: ``(T, B, C)``. logsigmoid keeps it finite (no ``log(1 - sigmoid)``) and differentiable."""
        if self.variant == "d":
            logits = self.gate_logit.float()
            self._check_finite(logits, "its learned gate logits (gate_logit parameter)")
            return F.logsigmoid(logits)[:, None]
        if self.variant == "s":
            logits = float32_linear(self.gate_proj, x)
            self._check_finite(logits, "the gate logits gate_proj(x) (the hidden states x, or gate_proj's weights)")
            return F.logsigmoid(logits).permute(1, 2, 0)
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
        """Feature-mapped keys and values, ``(B, H, T, D)`` each, of ``x`` ``(T, B, C)``."""
        return self.phi(self._heads(self.k_proj(x))), self._heads(self.v_proj(x))

    def _heads(self, x: Tensor) -> Tensor:
        T, B, _ = x.shape
        return x.view(T, B, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # (B, H, T, D)

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None) -> Tensor:
        """x: ``(T, B, C)``; key_padding_mask: ``(B, T)`` bool, True at padding. Returns ``(T, B, C)``.

        With ``incremental_state`` (causal decoding) the module keeps only ``S`` ``(B, H, D, D)``,
        ``z`` ``(B, H, D)`` and the last token's log-gate: a first call with T tokens prefills them in
        one pass, later calls advance the recurrence token by token.
        """
        T, B, C = x.shape
        if C != self.embed_dim:
            raise ValueError(f"input has {C} channels; this LionAttention was built for {self.embed_dim}")
        q = self.phi(self._heads(self.q_proj(x)))
        k, v = self._keys_values(x)
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
        return self._output(y)

    def _directional_gates(self, log_lam: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Operator gates from per-position ``log lambda``: ``log_a_fwd[t] = log lambda_{t-1}`` and
        ``log_a_bwd[t] = log lambda_{t+1}`` (0 at the ends, where they lie on no path)."""
        if log_lam is None or self.variant == "d":
            return log_lam, log_lam
        return F.pad(log_lam[..., :-1], (1, 0)), F.pad(log_lam[..., 1:], (0, 1))

    def _output(self, y: Tensor) -> Tensor:
        if self.head_norm is not None:  # in float32: y may be an unnormalised sum, float32 to keep its range
            norm = self.head_norm
            y = F.layer_norm(y.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps)
        B, H, T, D = y.shape
        y = y.permute(2, 0, 1, 3).reshape(T, B, H * D)
        return self.out_proj(y.to(self.out_proj.weight.dtype))

    def _decode(self, q: Tensor, k: Tensor, v: Tensor, log_lam: Optional[Tensor],
                key_padding_mask: Optional[Tensor], incremental_state) -> Tensor:
        B, H, T, _ = q.shape
        saved = self.get_incremental_state(incremental_state, "lion_state") or {}
        lam = log_lam.expand(B, H, T) if log_lam is not None else None
        if "S" not in saved:  # prefill: the causal form over the prompt, then its final state in one pass
            fwd, _ = self._directional_gates(log_lam)
            y = lion_attention(q, k, v, fwd, None, form=self.form, causal=True, normalize=self.normalize,
                               key_padding_mask=key_padding_mask, chunk_size=self.chunk_size, eps=self.eps)
            # the state after token T-1 has the decay of lambda_{T-1} still to come: it is stored as the
            # gate to apply before the next token (log_a_fwd[T] = log lambda_{T-1})
            S, z = causal_state(k, v, fwd, key_padding_mask)
            prev = None
            if lam is not None:  # the gate of each row's last real token (a right-padded prompt ends in pads)
                last = torch.full((B,), T - 1, dtype=torch.long, device=q.device)
                if key_padding_mask is not None:
                    last = last - (~key_padding_mask).flip(-1).int().argmax(-1)
                prev = lam.gather(-1, last[:, None, None].expand(B, H, 1)).squeeze(-1)
        else:
            S, z, prev = saved["S"], saved["z"], saved.get("prev_log_gate")
            ys = []
            for t in range(T):
                y_t, (S_t, z_t) = lion_step(q[:, :, t], k[:, :, t], v[:, :, t], prev, (S, z),
                                            normalize=self.normalize, eps=self.eps)
                ys.append(y_t)
                prev_t = lam[..., t] if lam is not None else None
                if key_padding_mask is not None:  # a padded token leaves the state as it was
                    pad = key_padding_mask[:, t]
                    S_t = torch.where(pad[:, None, None, None], S, S_t)
                    z_t = torch.where(pad[:, None, None], z, z_t)
                    if prev_t is not None:
                        prev_t = torch.where(pad[:, None], prev, prev_t)
                S, z, prev = S_t, z_t, prev_t
            y = torch.stack(ys, dim=2)
        new = {"S": S, "z": z}
        if prev is not None:
            new["prev_log_gate"] = prev
        self.set_incremental_state(incremental_state, "lion_state", new)
        return y

    def reorder_incremental_state(self, incremental_state, new_order: Tensor) -> None:
        """Select beams: every saved tensor has the batch first."""
        saved = self.get_incremental_state(incremental_state, "lion_state")
        if saved:
            saved = {key: t.index_select(0, new_order) for key, t in saved.items()}
            self.set_incremental_state(incremental_state, "lion_state", saved)

    # whether ``blockwise`` computes this module's ``forward`` (a subclass that mixes differently says no)
    streams_blockwise = True

    def blockwise(self, source: Callable[[int, int], Tensor], T: int, key_padding_mask: Optional[Tensor],
                  block: int) -> Iterator[Tuple[int, int, Tensor]]:
        """Bidirectional inference a block of tokens at a time: yields ``(s, e, out)`` from left to right,
        ``out`` ``(e - s, B, C)`` the rows s..e-1 of ``forward``'s output, for an input whose rows
        ``source(s, e)`` gives (so the caller never holds the whole of it, nor its projections).

        A first pass, right to left, leaves the backward direction's state at each block's edge; the
        second computes each block with both states carried in. Each block's keys and values are projected
        in both passes: a sixth more multiply-adds than ``forward`` for memory that does not grow with T
        beyond one state per block. key_padding_mask: ``(B, T)`` bool, True at padding."""
        if self.causal:
            raise ValueError("blockwise inference is for bidirectional LionAttention")
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

        rights, right = [None] * n, None
        for i in reversed(range(n)):
            rights[i] = right
            s, e = edges[i], edges[i + 1]
            x = source(s, e)
            log_lam = self.log_gates(x)
            if self.variant == "s":
                if lam is None:
                    lam = log_lam.new_zeros(log_lam.shape[:2] + (T,))
                lam[..., s:e] = log_lam
            else:
                head_gate = log_lam
            if i > 0:  # the first block's right state is read by no block
                k, v = self._keys_values(x)
                right = state_before(right, k, v, gates(s, e)[1], mask(s, e))
        left = None
        for i in range(n):
            s, e = edges[i], edges[i + 1]
            x = source(s, e)
            q = self.phi(self._heads(self.q_proj(x)))
            k, v = self._keys_values(x)
            f, b = gates(s, e)
            y = block_attention(q, k, v, f, b, left, rights[i], form=self.form, normalize=self.normalize,
                                key_padding_mask=mask(s, e), chunk_size=self.chunk_size, eps=self.eps)
            if i + 1 < n:
                left = state_after(left, k, v, f, mask(s, e))
            yield s, e, self._output(y)
