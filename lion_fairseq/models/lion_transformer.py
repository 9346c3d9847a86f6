"""LION for sequence-to-sequence tasks (``--task translation --arch lion_s_transformer`` etc.): fairseq's
``TransformerModel`` with bidirectional LION self-attention in the encoder (``LionEncoderLayer``) and
causal LION self-attention in the decoder, which decodes through ``(S, z)`` per layer and head.

Cross-attention is fairseq's softmax ``MultiheadAttention`` by default; ``--lion-cross-attention linear``
makes it non-causal linear attention over the encoder output, whose state is computed once per source
sentence: a decoding step then costs O(1) whatever the source and the target lengths.

Positions are fairseq's (sinusoidal, or ``--encoder-learned-pos`` / ``--decoder-learned-pos``) unless
``--lion-positions`` says otherwise: ``learned`` for both sides, ``none`` for neither. Checkpoints store
the dataclass config below, so they reload under torch's ``weights_only`` default, and
``--model-overrides "{'lion_form': 'recurrent'}"`` switches the form.

Layer and module names are fairseq's, so a softmax ``transformer`` checkpoint starts a LION one
(``upgrade_state_dict_named``, ``models/convert.py``): every tensor loads as it is, cross-attention's
into either kind, and LION-D/S gates start by the rule."""
import argparse
import contextlib
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional

from fairseq import utils
from fairseq.dataclass import ChoiceEnum
from fairseq.models import BaseFairseqModel, register_model, register_model_architecture
from fairseq.models.transformer import (TransformerConfig, TransformerDecoderBase, TransformerEncoderBase,
                                        TransformerModelBase)
from fairseq.modules import FairseqDropout, MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from omegaconf import II, OmegaConf, open_dict
from torch import Tensor

from ..clear_errors import ClearLoadErrors, check_task
from ..modules.encoder_layer import LionEncoderLayer, drop_attention_output
from ..modules.seq2seq_attention import LinearCrossAttention, LionSelfAttention
from .convert import TRANSLATION, check_ties, is_softmax_transformer, softmax_to_lion
from .hub import DataBpeHub
from .lion_options import (LionOptions, arch_filling, checkpointed, fix_lion_flags, lion_attention_kwargs,
                           model_name_arch, refuse_softmax_only_options, set_unset, set_unset_from)

CROSS_ATTENTION_CHOICES = ChoiceEnum(["softmax", "linear"])


@dataclass
class LionTransformerConfig(LionOptions):
    # sizes default to None so that the arch decides (fairseq-hydra-train merges dataclass defaults first)
    encoder_embed_dim: Optional[int] = field(default=None, metadata={"help": "encoder embedding dimension"})
    encoder_ffn_embed_dim: Optional[int] = field(default=None, metadata={"help": "encoder FFN dimension"})
    encoder_layers: Optional[int] = field(default=None, metadata={"help": "num encoder layers"})
    encoder_attention_heads: Optional[int] = field(default=None, metadata={"help": "num encoder attention heads"})
    decoder_embed_dim: Optional[int] = field(default=None, metadata={"help": "decoder embedding dimension"})
    decoder_ffn_embed_dim: Optional[int] = field(default=None, metadata={"help": "decoder FFN dimension"})
    decoder_layers: Optional[int] = field(default=None, metadata={"help": "num decoder layers"})
    decoder_attention_heads: Optional[int] = field(default=None, metadata={"help": "num decoder attention heads"})
    lion_cross_attention: CROSS_ATTENTION_CHOICES = field(
        default="softmax", metadata={"help": "decoder-encoder attention: fairseq's softmax MultiheadAttention, or "
                                             "linear attention whose state is computed once per source"})
    encoder_normalize_before: bool = field(default=False, metadata={"help": "pre-norm encoder layers"})
    decoder_normalize_before: bool = field(default=False, metadata={"help": "pre-norm decoder layers"})
    encoder_learned_pos: bool = field(default=False, metadata={"help": "learned encoder positions"})
    decoder_learned_pos: bool = field(default=False, metadata={"help": "learned decoder positions"})
    no_token_positional_embeddings: bool = field(default=False, metadata={"help": "no positional embeddings"})
    activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = field(
        default="relu", metadata={"help": "activation function of the FFN"})
    dropout: Optional[float] = field(default=None, metadata={"help": "dropout probability (default: the arch's)"})
    attention_dropout: float = field(
        default=0.0, metadata={"help": "dropout on the output of LION's attention and of linear cross-attention "
                                       "(which form no attention weights), on softmax cross-attention's weights"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout after the FFN activation"})
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "share decoder input and output embeddings"})
    share_all_embeddings: bool = field(
        default=False, metadata={"help": "share encoder, decoder and output embeddings (a joined dictionary)"})
    no_scale_embedding: bool = field(default=False, metadata={"help": "do not scale embeddings by sqrt(dim)"})
    layernorm_embedding: bool = field(default=False, metadata={"help": "layernorm on the embeddings"})
    no_decoder_final_norm: bool = field(
        default=False, metadata={"help": "no LayerNorm after the decoder's last pre-norm layer"})
    encoder_embed_path: Optional[str] = field(
        default=None, metadata={"help": "path to pre-trained encoder embeddings (a text file: a header line, then "
                                        "a token and its vector per line)"})
    decoder_embed_path: Optional[str] = field(
        default=None, metadata={"help": "path to pre-trained decoder embeddings"})
    # LayerDrop, as fairseq's transformer: fairseq prunes a LayerDrop-trained checkpoint's layers to the
    # *_layers_to_keep on load (prune_state_dict reads them from the model config)
    encoder_layerdrop: float = field(default=0.0, metadata={"help": "LayerDrop probability for encoder"})
    decoder_layerdrop: float = field(default=0.0, metadata={"help": "LayerDrop probability for decoder"})
    encoder_layers_to_keep: Optional[str] = field(
        default=None, metadata={"help": "which encoder layers to *keep* when pruning, as a comma-separated list"})
    decoder_layers_to_keep: Optional[str] = field(
        default=None, metadata={"help": "which decoder layers to *keep* when pruning, as a comma-separated list"})
    max_source_positions: int = II("task.max_source_positions")
    max_target_positions: int = II("task.max_target_positions")


def transformer_config(cfg: Any) -> TransformerConfig:
    """fairseq's nested ``TransformerConfig`` of a ``LionTransformerConfig``, with the LION options on it
    (``lion_attention``, ``lion_cross_attention``) for the layers to read."""
    args = argparse.Namespace(**{f.name: getattr(cfg, f.name, None) for f in fields(LionTransformerConfig)})
    args.decoder_input_dim = args.decoder_output_dim = args.decoder_embed_dim
    positions = getattr(cfg, "lion_positions", None)
    if positions == "learned":
        args.encoder_learned_pos = args.decoder_learned_pos = True
    elif positions == "none":
        args.no_token_positional_embeddings = True
    out = TransformerConfig.from_namespace(args)
    out.lion_attention = lion_attention_kwargs(cfg)
    out.lion_cross_attention = str(cfg.lion_cross_attention)
    return out


class LionTransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer with causal LION self-attention (and linear cross-attention on request).
    ``--attention-dropout`` drops the output of both, which form no attention weights, as ``LionEncoderLayer``
    does; softmax cross-attention drops its weights, as fairseq's."""

    def __init__(self, cfg, no_encoder_attn=False, add_bias_kv=False, add_zero_attn=False):
        super().__init__(cfg, no_encoder_attn, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
        self.attention_dropout_module = FairseqDropout(cfg.attention_dropout, module_name=self.__class__.__name__)
        for attention in (self.self_attn, self.encoder_attn):
            if attention is not None and not isinstance(attention, MultiheadAttention):
                drop_attention_output(attention, self.attention_dropout_module)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        return LionSelfAttention(embed_dim, cfg.decoder.attention_heads, **cfg.lion_attention)

    def build_encoder_attention(self, embed_dim, cfg):
        if cfg.lion_cross_attention == "linear":
            return LinearCrossAttention(embed_dim, cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim,
                                        **cfg.lion_attention)
        return MultiheadAttention(embed_dim, cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim,
                                  vdim=cfg.encoder.embed_dim, dropout=cfg.attention_dropout,
                                  encoder_decoder_attention=True)


@contextlib.contextmanager
def other_side_kept_whole(model_cfg: Any, state_dict: Dict[str, Tensor]):
    """While fairseq prunes ``state_dict`` (``prune_state_dict``, from ``model_cfg``): where only one side's
    ``*_layers_to_keep`` is given, the other side's is every layer the checkpoint holds. fairseq keeps a layer
    only where some side's list names it, so it dropped every layer of the side not given. The config is
    left as fairseq leaves it (both None once pruned), so that no saved checkpoint asks to prune again."""
    given = [side for side in ("encoder", "decoder") if getattr(model_cfg, f"{side}_layers_to_keep", None)]
    if len(given) != 1:
        yield
        return
    other = "decoder" if given == ["encoder"] else "encoder"
    # the keys fairseq's pruning pass for that side matches: "<side>...layers.<n>."
    layers = sorted({int(m.group(1)) for key in state_dict for m in [re.match(rf"{other}.*\.layers\.(\d+)\.", key)]
                     if m})
    option = f"{other}_layers_to_keep"

    def set_option(value: Optional[str]) -> None:
        with open_dict(model_cfg) if OmegaConf.is_config(model_cfg) else contextlib.nullcontext():
            setattr(model_cfg, option, value)

    was = getattr(model_cfg, option, None)
    set_option(",".join(map(str, layers)) or None)
    try:
        yield
    finally:
        set_option(was)


class LionTransformerEncoder(TransformerEncoderBase):
    def build_encoder_layer(self, cfg):
        return checkpointed(LionEncoderLayer(
            cfg.encoder.embed_dim, cfg.encoder.attention_heads, cfg.encoder.ffn_embed_dim, cfg.lion_attention,
            dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
            activation_fn=cfg.activation_fn, normalize_before=cfg.encoder.normalize_before), cfg)


class LionTransformerDecoder(TransformerDecoderBase):
    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return checkpointed(LionTransformerDecoderLayer(cfg, no_encoder_attn), cfg)

    def buffered_future_mask(self, tensor: Tensor) -> None:
        # fairseq's T x T causal mask, built and kept for the longest target so far (34 MB at 3000 tokens), is
        # ignored by LION's self-attention, causal by construction
        return None


@register_model("lion_transformer", dataclass=LionTransformerConfig)
class LionTransformerModel(ClearLoadErrors, DataBpeHub, TransformerModelBase):
    """``TransformerModel`` with LION self-attention: the same forward, generator and hub interface
    (``from_pretrained(...).translate(...)``)."""

    @classmethod
    def add_args(cls, parser):
        # this config's options (TransformerModelBase.add_args would add fairseq's TransformerConfig's)
        BaseFairseqModel.add_args.__func__(cls, parser)
        fix_lion_flags(parser)
        refuse_softmax_only_options(parser)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """fairseq's load, where a LayerDrop checkpoint pruned on one side only (``--model-overrides
        "{'decoder_layers_to_keep': '0,2'}"``) keeps every layer of the other."""
        with other_side_kept_whole(model_cfg, state_dict):
            return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def upgrade_state_dict_named(self, state_dict: Dict[str, Tensor], name: str) -> None:
        """fairseq's own upgrades, then a softmax ``transformer``'s weights made this model's: what fairseq
        runs before every strict load, so ``--finetune-from-model transformer.pt`` starts LION from it. What
        the weights cannot show is logged: it must be the teacher's."""
        super().upgrade_state_dict_named(state_dict, name)
        prefix = name + "." if name else ""
        if is_softmax_transformer(self, state_dict, prefix):
            softmax_to_lion(self, state_dict, prefix, TRANSLATION, unseen=self.unseen())
        else:
            check_ties(self, state_dict, prefix, TRANSLATION)

    def unseen(self) -> str:
        """The structure that a checkpoint's weights cannot show (heads, norms' places, activation, sinusoidal
        positions, embedding scale)."""
        cfg = self.cfg
        if cfg.no_token_positional_embeddings:
            positions = "no positions"
        else:
            positions = ", ".join(f"{side} {'learned' if c.learned_pos else 'sinusoidal'} positions"
                                  for side, c in (("encoder", cfg.encoder), ("decoder", cfg.decoder)))
        sides = "; ".join(f"{side}: {c.attention_heads} heads, {'pre' if c.normalize_before else 'post'}-norm layers"
                          for side, c in (("encoder", cfg.encoder), ("decoder", cfg.decoder)))
        scale = "unscaled" if cfg.no_scale_embedding else "scaled by sqrt(width)"
        return f"{sides}; activation {cfg.activation_fn}; {positions}; embeddings {scale}"

    @classmethod
    def build_model(cls, cfg, task):
        lion_transformer_base(cfg)
        return super().build_model(transformer_config(cfg), task)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return LionTransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return LionTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


# transformer base (Vaswani et al.): 6 + 6 layers, 512 wide, 8 heads, FFN 2048
BASE = dict(encoder_embed_dim=512, encoder_ffn_embed_dim=2048, encoder_layers=6, encoder_attention_heads=8,
            decoder_embed_dim=512, decoder_ffn_embed_dim=2048, decoder_layers=6, decoder_attention_heads=8,
            dropout=0.1)
SIZES = {
    "": BASE,
    # fairseq's transformer_iwslt_de_en (dropout 0.1 too: its recipe passes --dropout 0.3, as ours does)
    "_iwslt_de_en": dict(BASE, encoder_ffn_embed_dim=1024, encoder_attention_heads=4, decoder_ffn_embed_dim=1024,
                         decoder_attention_heads=4),
    "_tiny": dict(encoder_embed_dim=128, encoder_ffn_embed_dim=256, encoder_layers=2, encoder_attention_heads=2,
                  decoder_embed_dim=128, decoder_ffn_embed_dim=256, decoder_layers=2, decoder_attention_heads=2,
                  dropout=0.1),
}


def refuse_two_position_choices(args: Any) -> None:
    """``--lion-positions`` with one of fairseq's position options: ``none`` drops what they ask for, and
    ``learned`` under ``--no-token-positional-embeddings`` gives no positions either."""
    theirs = [f"--{k.replace('_', '-')}" for k in ("encoder_learned_pos", "decoder_learned_pos",
                                                   "no_token_positional_embeddings") if getattr(args, k, None)]
    if getattr(args, "lion_positions", None) and theirs:
        raise ValueError(f"--lion-positions {args.lion_positions} and {' '.join(theirs)} both choose the positions: "
                         "pass one of them")


def lion_transformer_base(args: Any) -> None:
    """Sizes and variant the command line (or the arch) left unset: transformer base and LION-S (``--arch
    lion_transformer``), the other options at their fields' defaults."""
    check_task(args)
    if isinstance(args, argparse.Namespace):  # the command line; a checkpoint trained so loads as it trained
        refuse_two_position_choices(args)
    set_unset(args, dict(BASE, lion_variant="s", lion_normalize=True))
    # the rest at the dataclass's defaults: a Namespace from fairseq's parser (the legacy path) lacks every
    # option not typed (the task gives the positions, which the dataclass only refers to)
    set_unset_from(args, LionTransformerConfig, exclude=("max_source_positions", "max_target_positions"))


model_name_arch("lion_transformer", lion_transformer_base)
for _variant in ("lit", "d", "s"):
    for _suffix, _size in SIZES.items():
        register_model_architecture("lion_transformer", f"lion_{_variant}_transformer{_suffix}")(
            arch_filling(_variant, _size, lion_transformer_base))
