"""``lion_lra``: a LION sequence classifier for Long Range Arena.

``src_tokens`` ``(B, T)`` -> :class:`LionSentenceEncoder` (the encoder of ``lion_roberta``) -> mean over
the real tokens ``(B, C)`` -> ``Linear, ReLU, Linear`` -> class logits ``(B, num_classes)``. Retrieval
(``src_tokens_1`` given) encodes both documents with the same encoder and classifies
``[u, v, u * v, u - v]``, as LRA's dual encoder does.

For 2-D inputs (``lra_image``, ``lra_pathfinder``, ``lra_pathx``), ``--lion-order`` picks how the grid
becomes a sequence: ``row_major`` (as stored), ``row_snake`` / ``col_snake`` (the tokens are permuted
before the encoder; mean pooling makes the output order irrelevant), or ``two_snake``: every layer
attends in both snake orders with its own decays and averages the two masks (LION-D/S "natural",
:class:`LionTwoScanAttention`), in whichever ``--lion-form``.

Archs ``lion_{lit,d,s}_lra_{listops,text,retrieval,image,pathfinder,pathx}`` have the sizes of the
Transformer baselines of the LRA paper (Tay et al. 2021, its released configs), so accuracies compare
like for like; ``lion_{lit,d,s}_lra_small`` is the smaller 2-layer, 64-dim LRA setting of the
Nystromformer/Skyformer studies, and ``lion_{lit,d,s}_lra_tiny`` is for tests. The config is a dataclass: checkpoints reload
under torch's ``weights_only`` default and ``--model-overrides "{'lion_form': 'recurrent'}"`` works.
"""
import argparse
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
from fairseq import utils
from fairseq.dataclass import ChoiceEnum
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import BaseFairseqModel, register_model, register_model_architecture
from torch import Tensor

from ..clear_errors import ClearLoadErrors, check_task
from ..lra.ordering import ORDERS as GRID_ORDERS, ordering
from ..modules.encoder_layer import drop_attention_output
from ..modules.two_scan_attention import LionTwoScanAttention
from .lion_encoder import LionSentenceEncoder, complete_encoder_config
from .lion_options import (LionOptions, arch_filling, boolean_optional, fix_lion_flags, lion_attention_kwargs,
                           model_name_arch, refuse_softmax_only_options, set_unset, set_unset_from)

logger = logging.getLogger(__name__)

ORDERS = (*GRID_ORDERS, "two_snake")  # two_snake: two scans, each in an order of its own


@dataclass
class LionLRAConfig(LionOptions):
    # sizes and dropout default to None so that the arch decides (fairseq-hydra-train merges dataclass
    # defaults before the arch function runs); the model name itself gets DEFAULT_SIZE
    encoder_layers: Optional[int] = field(default=None, metadata={"help": "num encoder layers (default: the arch's)"})
    encoder_embed_dim: Optional[int] = field(
        default=None, metadata={"help": "encoder embedding dimension (default: the arch's)"})
    encoder_ffn_embed_dim: Optional[int] = field(
        default=None, metadata={"help": "encoder embedding dimension for FFN (default: the arch's)"})
    encoder_attention_heads: Optional[int] = field(
        default=None, metadata={"help": "num encoder attention heads (default: the arch's)"})
    encoder_normalize_before: bool = field(
        default=True, metadata={"help": "pre-norm blocks, as LRA's Transformer (--no-encoder-normalize-before "
                                        "for post-norm)"})
    layernorm_embedding: bool = field(default=False, metadata={"help": "layernorm on the embeddings"})
    activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = field(
        default="gelu", metadata={"help": "activation function of the FFN"})
    dropout: Optional[float] = field(
        default=None, metadata={"help": "dropout probability (default: the arch's; 0.1 unless it sets one)"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout on the attention output"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout after the FFN activation"})
    encoder_layerdrop: float = field(default=0.0, metadata={"help": "LayerDrop probability"})
    max_positions: Optional[int] = field(
        default=None, metadata={"help": "learned positions (default: the task's max length); unused without them"})
    classifier_hidden_dim: Optional[int] = field(
        default=None, metadata={"help": "hidden units of the classifier (default: --encoder-ffn-embed-dim)"})
    lion_order: ChoiceEnum(list(ORDERS)) = field(
        default="row_major", metadata={"help": "2-D tasks: how the grid becomes a sequence; two_snake attends "
                                               "in both snake orders with their own decays, masks averaged"})


class LionLRAModel(ClearLoadErrors, BaseFairseqModel):
    """``forward(src_tokens (B, T), src_tokens_1 (B, T') = None) -> logits (B, num_classes)``."""

    def __init__(self, cfg: Any, task):
        super().__init__()
        self.cfg = cfg
        dictionary = task.source_dictionary
        embed = nn.Embedding(len(dictionary), cfg.encoder_embed_dim, dictionary.pad())
        nn.init.normal_(embed.weight, std=cfg.encoder_embed_dim ** -0.5)
        nn.init.zeros_(embed.weight[dictionary.pad()])
        self.encoder = LionSentenceEncoder(cfg, dictionary, embed)
        order = str(cfg.lion_order)
        grid = getattr(task, "image_size", None)
        if order != "row_major" and grid is None:
            raise ValueError(f"--lion-order {order} needs a 2-D task (lra_image, lra_pathfinder, lra_pathx); "
                             f"this one has 1-D sequences")
        perm = ordering(order, *grid) if order in ("row_snake", "col_snake") else None
        self.register_buffer("perm", perm, persistent=False)
        if order == "two_snake":
            self._two_scan_layers(cfg, *grid)
        pair = getattr(task, "INPUTS", 1) == 2
        hidden = cfg.classifier_hidden_dim or cfg.encoder_ffn_embed_dim
        self.classifier = nn.Sequential(
            nn.Linear(cfg.encoder_embed_dim * (4 if pair else 1), hidden), nn.ReLU(),
            nn.Dropout(cfg.dropout), nn.Linear(hidden, task.num_classes))

    def _two_scan_layers(self, cfg: Any, height: int, width: int) -> None:
        """Swap every layer's attention for the two-snake one (same options, its own weights)."""
        kwargs = lion_attention_kwargs(cfg)
        for layer in self.encoder.every_layer():
            attn = LionTwoScanAttention(cfg.encoder_embed_dim, cfg.encoder_attention_heads, height=height,
                                        width=width, **kwargs)
            drop_attention_output(attn, layer.attention_dropout_module)  # the layer's, which eval() turns off
            layer.self_attn = attn

    @classmethod
    def add_args(cls, parser) -> None:
        gen_parser_from_dataclass(parser, LionLRAConfig(), delete_default=True)
        fix_lion_flags(parser)
        refuse_softmax_only_options(parser)
        boolean_optional(parser, "--encoder-normalize-before")
        boolean_optional(parser, "--layernorm-embedding")

    @classmethod
    def build_model(cls, cfg: Any, task) -> "LionLRAModel":
        complete_encoder_config(cfg, task, lion_lra_base)
        return cls(cfg, task)

    def encode(self, tokens: Tensor) -> Tensor:
        """``(B, T)`` tokens -> ``(B, C)``: the mean of the encoder's outputs over the real tokens."""
        if self.perm is not None:
            if tokens.shape[1] != self.perm.numel():
                raise ValueError(f"--lion-order {self.cfg.lion_order} needs {self.perm.numel()} tokens per "
                                 f"image; got {tokens.shape[1]}")
            tokens = tokens[:, self.perm]
        out = self.encoder(tokens)
        x = out["encoder_out"][0].transpose(0, 1)  # (B, T, C)
        keep = (~out["encoder_padding_mask"][0]).unsqueeze(-1).type_as(x)
        return (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)

    def forward(self, src_tokens: Tensor, src_lengths: Optional[Tensor] = None,
                src_tokens_1: Optional[Tensor] = None, **unused) -> Tensor:
        """``(B, T)`` [and ``(B, T')``] -> ``(B, num_classes)`` logits."""
        u = self.encode(src_tokens)
        if src_tokens_1 is not None:
            v = self.encode(src_tokens_1)
            u = torch.cat([u, v, u * v, u - v], dim=-1)
        return self.classifier(u)

    def max_positions(self) -> int:
        return self.encoder.max_positions()


register_model("lion_lra", dataclass=LionLRAConfig)(LionLRAModel)


# ---- architectures --------------------------------------------------------------------------------

# (layers, embed dim, ffn dim, heads, dropout) of the LRA paper's Transformer per task
SIZES: Dict[str, Dict[str, Any]] = {
    "listops": dict(encoder_layers=6, encoder_embed_dim=512, encoder_ffn_embed_dim=2048, encoder_attention_heads=8),
    "text": dict(encoder_layers=4, encoder_embed_dim=256, encoder_ffn_embed_dim=1024, encoder_attention_heads=4),
    "retrieval": dict(encoder_layers=4, encoder_embed_dim=128, encoder_ffn_embed_dim=512, encoder_attention_heads=4),
    "image": dict(encoder_layers=1, encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=1,
                  dropout=0.3),
    "pathfinder": dict(encoder_layers=1, encoder_embed_dim=128, encoder_ffn_embed_dim=128,
                       encoder_attention_heads=4, dropout=0.2),
    "pathx": dict(encoder_layers=1, encoder_embed_dim=32, encoder_ffn_embed_dim=32, encoder_attention_heads=2),
    # the smaller LRA setting of the Nystromformer/Skyformer studies (2 layers, 64 dims, 2 heads of 32,
    # FFN 128), used by many efficient-attention papers; fits a CPU
    "small": dict(encoder_layers=2, encoder_embed_dim=64, encoder_ffn_embed_dim=128, encoder_attention_heads=2),
    "tiny": dict(encoder_layers=2, encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=2),
}


# 4 x 128: the model name without an arch; its dropout also serves every arch that sets none
DEFAULT_SIZE = dict(SIZES["retrieval"], lion_variant="s", dropout=0.1)


def lion_lra_base(args: Any) -> None:
    """Fill every option the command line (or the arch) left unset (None): sizes, variant and dropout of
    ``DEFAULT_SIZE``, everything else the config's default: ``--arch lion_lra``."""
    check_task(args)
    set_unset(args, DEFAULT_SIZE)
    set_unset_from(args, LionLRAConfig)
    if isinstance(args, argparse.Namespace) and args.lion_order == "two_snake" and args.lion_variant == "lit":
        # said, not refused: a run started so resumes with the options it was started with
        logger.warning("--lion-order two_snake averages the decay masks of a row and a column scan, and LION-LIT has "
                       "no decay: both masks are all ones, the same model as row_major at twice the cost. For a new "
                       "run pass --lion-order row_major (or row_snake, col_snake) with LION-LIT, or a LION-D/S arch")


model_name_arch("lion_lra", lion_lra_base)
for _variant in ("lit", "d", "s"):
    for _task, _size in SIZES.items():
        register_model_architecture("lion_lra", f"lion_{_variant}_lra_{_task}")(
            arch_filling(_variant, _size, lion_lra_base))
