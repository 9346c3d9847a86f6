"""LionDecoderLayer: one block of the causal LION language model (causal LION attention, then a
feed-forward network), in fairseq's ``T x B x C`` layout, with incremental decoding state; pre-norm by
default, post-norm on request (as fairseq's ``--arch transformer_lm``, for starting from one)."""
from typing import Any, Dict, Optional

import torch.nn as nn
from fairseq import utils
from fairseq.modules import FairseqDropout, LayerNorm
from torch import Tensor

from .lion_attention import IncrementalState, LionAttention


class LionDecoderLayer(nn.Module):
    """Pre-norm (``normalize_before``, the default): ``x + Drop(Attn(LN(x)))`` then ``x + Drop(FFN(LN(x)))``,
    which keeps a deep stack trainable without warm-up tricks. Post-norm: ``LN(x + Drop(Attn(x)))`` then
    ``LN(x + Drop(FFN(x)))``, fairseq's ``TransformerDecoderLayer`` without ``--decoder-normalize-before``.
    Submodule names are fairseq's, so a softmax decoder layer's weights load as they are.

    embed_dim, num_heads, ffn_embed_dim: in ``LionEncoderLayer``'s order; attention_kwargs: keyword arguments
    of ``LionAttention`` (variant, form, chunk_size, feature_map, normalize, norm_after, and the levers
    gate_temperature, output_gate, short_conv), e.g. from ``lion_options.lion_attention_kwargs(cfg)``; the
    layer always builds it causal.
    """

    def __init__(self, embed_dim: int, num_heads: int, ffn_embed_dim: int, attention_kwargs: Dict[str, Any], *,
                 dropout: float = 0.1, activation_dropout: float = 0.0, activation_fn: str = "gelu",
                 normalize_before: bool = True):
        super().__init__()
        self.normalize_before = normalize_before
        self.self_attn = LionAttention(embed_dim, num_heads, causal=True, **attention_kwargs)
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)
        self.activation_fn = utils.get_activation_fn(activation_fn)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.activation_dropout_module = FairseqDropout(activation_dropout, module_name=self.__class__.__name__)

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[IncrementalState] = None) -> Tensor:
        """x: ``(T, B, C)``; padding_mask: ``(B, T)`` bool, True at padding (or None). Returns ``(T, B, C)``.
        With ``incremental_state`` the attention prefills (first call) or steps its recurrent state."""
        residual = x
        h = self.self_attn_layer_norm(x) if self.normalize_before else x
        x = residual + self.dropout_module(self.self_attn(h, key_padding_mask=padding_mask,
                                                          incremental_state=incremental_state))
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        residual = x
        h = self.final_layer_norm(x) if self.normalize_before else x
        h = self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(h))))
        x = residual + self.dropout_module(h)
        return x if self.normalize_before else self.final_layer_norm(x)
