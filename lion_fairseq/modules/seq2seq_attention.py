"""Attention modules for fairseq's encoder-decoder layers, with ``MultiheadAttention``'s call
``(query, key, value, key_padding_mask, incremental_state, ...) -> (out, None)``:

- ``LionSelfAttention``: causal LION self-attention of a decoder, decoding through ``(S, z)``;
- ``LinearCrossAttention``: non-causal linear attention of the target over the encoder output, whose
  ``(S, z)`` is computed once per source sentence, so a decoding step costs O(1) whatever the source and
  target lengths. Neither forms attention weights: both return None for them."""
import logging
from typing import Dict, Optional, Tuple

import torch.nn as nn
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from ..ops import memory_state, read_memory
from .feature_maps import FEATURE_MAPS
from .lion_attention import (DEFAULT_FEATURE_MAP, IncrementalState, LionAttention, check_lion_options, head_layer_norm,
                             linear_input, split_heads)

logger = logging.getLogger(__name__)


class LionSelfAttention(LionAttention):
    """Causal ``LionAttention`` called as fairseq's ``TransformerDecoderLayer`` calls its self-attention:
    ``query`` is the input ``(T, B, C)``; key and value are the query itself and the causal ``attn_mask``
    is LION's own mask, so both are ignored."""

    def __init__(self, embed_dim: int, num_heads: int, **lion):
        super().__init__(embed_dim, num_heads, causal=True, **lion)

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, incremental_state: Optional[IncrementalState] = None,
                need_weights: bool = False, attn_mask: Optional[Tensor] = None, **unused) -> Tuple[Tensor, None]:
        return super().forward(query, key_padding_mask=key_padding_mask, incremental_state=incremental_state), None

    # the decoder layer reads the buffer (for cross_self_attention, which LION does not use)
    def _get_input_buffer(self, incremental_state: Optional[IncrementalState]) -> Dict[str, Optional[Tensor]]:
        return self.decoding_state(incremental_state)

    def _set_input_buffer(self, incremental_state: IncrementalState, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, "lion_state", buffer)


@with_incremental_state
class LinearCrossAttention(nn.Module):
    """``y_i = phi(q_i) S / (phi(q_i) . z + eps)`` over the encoder output, ``S = sum_j phi(k_j) v_j^T``,
    ``z = sum_j phi(k_j)`` (padded source tokens left out), per head; ``(T, B, C)`` -> ``(T, B, C)``.
    With ``incremental_state`` the source's ``(S, z)`` is computed at the first step and kept.

    It takes ``LionAttention``'s feature map, normalisation and LayerNorm after attention (``norm_after``);
    the rest of its options (form, chunk size, gates, levers) shape a self-attention and are ignored."""

    def __init__(self, embed_dim: int, num_heads: int, kdim: Optional[int] = None, *, variant: str = "s",
                 feature_map: Optional[str] = None, normalize: bool = True, norm_after: bool = False,
                 eps: float = 1e-6, **self_attention_only):
        super().__init__()
        feature_map = feature_map or DEFAULT_FEATURE_MAP[variant]
        check_lion_options(variant, "chunk", 1, feature_map, normalize)
        if embed_dim % num_heads:
            raise ValueError(f"embedding dim {embed_dim} must be divisible by the number of attention heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.phi, self.normalize, self.eps = FEATURE_MAPS[feature_map], normalize, eps
        kdim = kdim or embed_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(kdim, embed_dim)
        self.v_proj = nn.Linear(kdim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.head_norm = nn.LayerNorm(self.head_dim) if norm_after else None
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=2 ** -0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)

    def _heads(self, x: Tensor) -> Tensor:
        return split_heads(x, self.num_heads)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a checkpoint from before --lion-norm-after reached this attention: it runs as it was trained
        if self.head_norm is not None and prefix + "q_proj.weight" in state_dict \
                and not any(k.startswith(prefix + "head_norm.") for k in state_dict):
            logger.warning(f"{prefix}head_norm: not in the checkpoint, which was trained before --lion-norm-after "
                           "applied to the linear cross-attention; this attention runs without it, as trained")
            self.head_norm = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[IncrementalState] = None, static_kv: bool = True,
                need_weights: bool = False, **unused) -> Tuple[Tensor, None]:
        """query ``(T, B, C)``; key = value: the encoder output ``(S, B, kdim)``; key_padding_mask ``(B, S)``."""
        state = self.get_incremental_state(incremental_state, "memory") if incremental_state is not None else None
        if state:
            S, z = state["S"], state["z"]
        else:
            S, z = memory_state(self.phi(self._heads(self.k_proj(key))), self._heads(self.v_proj(value)),
                                key_padding_mask)
            if incremental_state is not None:
                self.set_incremental_state(incremental_state, "memory", {"S": S, "z": z})
        y = read_memory(self.phi(self._heads(self.q_proj(query))), (S, z), normalize=self.normalize, eps=self.eps)
        if self.head_norm is not None:
            y = head_layer_norm(y, self.head_norm)
        B, H, T, D = y.shape
        y = y.permute(2, 0, 1, 3).reshape(T, B, H * D)
        return self.out_proj(linear_input(y, self.out_proj)), None

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor) -> None:
        """Select beams: the source's state has the batch first."""
        state = self.get_incremental_state(incremental_state, "memory")
        if state:
            self.set_incremental_state(incremental_state, "memory",
                                       {k: t.index_select(0, new_order) for k, t in state.items()})

    # the decoder layer sets the buffer only for prev_attn_state, which fairseq's generator does not pass
    def _set_input_buffer(self, incremental_state: IncrementalState, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, "memory", buffer)
