"""LionEncoderLayer: one bidirectional LION block (LionAttention + FFN), laid out like fairseq's
``TransformerEncoderLayer`` (same submodule names, post-norm by default, pre-norm on request)."""
import functools
import logging
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
from fairseq import utils
from fairseq.modules import LayerNorm
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor

from .lion_attention import LionAttention

logger = logging.getLogger(__name__)

# tokens per block of the recurrent form's blockwise inference: small next to a long sequence, large
# enough that the projections and FFN stay efficient matmuls
BLOCK_TOKENS = 256


class DropInput:
    """A forward pre-hook that drops a module's input. A callable object, not a closure: deepcopy (fairseq's
    EMA) and pickle then carry its ``dropout`` along with the layer that holds it."""

    def __init__(self, dropout: FairseqDropout):
        self.dropout = dropout

    def __call__(self, _module: nn.Module, args: tuple) -> tuple:
        return (self.dropout(args[0]),) + tuple(args[1:])


def drop_attention_output(attention: nn.Module, dropout: FairseqDropout) -> None:
    """``--attention-dropout`` for an attention that forms no weights to drop (LION's, linear cross-attention):
    its output is dropped instead, the nearest equivalent, as the input of ``out_proj``, its last step.
    ``dropout`` is a submodule of the layer, so that ``eval()`` turns it off."""
    if dropout.p > 0:
        attention.out_proj.register_forward_pre_hook(DropInput(dropout))


class LionEncoderLayer(nn.Module):
    """``x`` ``(T, B, C)`` -> ``(T, B, C)``.

    Post-norm (RoBERTa/BERT): ``x = LN(x + drop(attn(x)))``, ``x = LN(x + drop(fc2(drop_act(act(fc1(x))))))``.
    Pre-norm (``normalize_before``): ``x = x + drop(attn(LN(x)))``, likewise for the FFN.

    Dropout sits where fairseq's layer has it: ``dropout`` after attention and after the FFN,
    ``activation_dropout`` inside the FFN. LION never forms attention weights (the chunk and recurrent
    forms have none to drop), so ``attention_dropout`` drops the mixed values of every head just before
    the output projection, the nearest equivalent.

    attention: keyword arguments of :class:`LionAttention` (variant, form, chunk_size, feature_map,
    normalize, norm_after, and the levers gate_temperature, output_gate, short_conv), e.g. from
    ``lion_options.lion_attention_kwargs(cfg)``.
    """

    def __init__(self, embed_dim: int, num_heads: int, ffn_embed_dim: int, attention: Dict[str, Any], *,
                 dropout: float = 0.1, attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 activation_fn: str = "gelu", normalize_before: bool = False):
        super().__init__()
        self.embed_dim = embed_dim
        self.normalize_before = normalize_before
        self.self_attn = LionAttention(embed_dim, num_heads, causal=False, **attention)
        self.attention_dropout_module = FairseqDropout(attention_dropout, module_name=self.__class__.__name__)
        drop_attention_output(self.self_attn, self.attention_dropout_module)
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.activation_fn = utils.get_activation_fn(activation=activation_fn)
        self.activation_dropout_module = FairseqDropout(activation_dropout, module_name=self.__class__.__name__)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)

    def upgrade_state_dict_named(self, state_dict: Dict[str, Tensor], name: str) -> None:
        """Nothing to upgrade: fairseq's ``TransformerEncoder`` calls this on each of its layers."""

    def forward(self, x: Tensor, encoder_padding_mask: Optional[Tensor] = None) -> Tensor:
        """x: ``(T, B, C)``; encoder_padding_mask: ``(B, T)`` bool, True at padding (or None).
        Returns ``(T, B, C)``; outputs at padded positions are meaningless but finite.

        In the recurrent form at inference (eval mode, no autograd) the layer runs a block of
        ``BLOCK_TOKENS`` tokens at a time (:meth:`LionAttention.blockwise`), so that its memory beyond its
        input and output is a block's activations, whatever T: the RNN's promise, for the whole layer."""
        if self.self_attn.form == "recurrent" and self.self_attn.streams_blockwise and not self.training:
            if not torch.is_grad_enabled():
                return self._forward_blockwise(x, encoder_padding_mask)
            _warn_recurrent_with_autograd()
        h = self.self_attn_layer_norm(x) if self.normalize_before else x
        return self._after_attention(x, self.self_attn(h, key_padding_mask=encoder_padding_mask))

    def _after_attention(self, residual: Tensor, x: Tensor) -> Tensor:
        """The residual, norms and FFN around the attention output: token by token."""
        x = residual + self.dropout_module(x)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_dropout_module(self.activation_fn(self.fc1(x)))
        x = residual + self.dropout_module(self.fc2(x))
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x

    def _forward_blockwise(self, x: Tensor, encoder_padding_mask: Optional[Tensor]) -> Tensor:
        out = torch.empty_like(x)

        def source(s: int, e: int) -> Tensor:
            return self.self_attn_layer_norm(x[s:e]) if self.normalize_before else x[s:e]

        for s, e, a in self.self_attn.blockwise(source, x.shape[0], encoder_padding_mask, BLOCK_TOKENS):
            out[s:e] = self._after_attention(x[s:e], a)
        return out


@functools.lru_cache(maxsize=None)
def _warn_recurrent_with_autograd() -> None:
    """Once per process: autograd must keep every token's activations, so the blockwise path (and its
    bounded memory) is taken only without it; RoBERTa's hub runs ``extract_features`` and ``predict`` with
    autograd on."""
    logger.warning("LION attention: the recurrent form in eval mode with autograd on runs token by token and "
                   "keeps every step for the backward, so its memory grows with the length: run inference "
                   "under torch.no_grad() (RoBERTa's hub extract_features and predict do not) for blocks of "
                   f"{BLOCK_TOKENS} tokens in bounded memory")
