"""Causal LION language model (``--arch lion_s_lm`` etc.): a ``FairseqLanguageModel`` whose
``FairseqIncrementalDecoder`` trains and scores in the parallel or chunk form and decodes as an RNN.

Decoding keeps, per layer and head, only the state ``(S, z)`` of ``LionAttention`` (the last token's gate
already applied; ``--lion-short-conv N`` adds each layer's last N - 1 inputs): O(1) time and memory per
generated token whatever the context. The first call with an empty ``incremental_state`` prefills the
whole prompt in one pass; later calls read only the last token of the whole prefix that fairseq's generator
passes at every step, and place it after the prefix's real tokens for learned positions, as fairseq's own
learned positions count the prefix.

Layers are pre-norm with a final LayerNorm by default; ``--no-decoder-normalize-before`` makes them
post-norm without one, as fairseq's ``--arch transformer_lm`` (whose every named arch is pre-norm), so
that a softmax ``transformer_lm`` checkpoint of either kind starts a LION LM (``upgrade_state_dict_named``,
``models/convert.py``).
"""
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch.nn as nn
from fairseq import utils
from fairseq.dataclass import ChoiceEnum
from fairseq.models import (FairseqIncrementalDecoder, FairseqLanguageModel, register_model,
                            register_model_architecture)
from fairseq.modules import FairseqDropout, LayerDropModuleList, LayerNorm
from omegaconf import II
from torch import Tensor

from ..clear_errors import (LEARNED_POSITIONS, PAST_LEARNED_POSITIONS, ClearLoadErrors, check_learned_positions,
                             check_task, embed_tokens_checked)
from ..modules.decoder_layer import LionDecoderLayer
from ..modules.lion_attention import IncrementalState
from .convert import LANGUAGE_MODEL, check_ties, is_softmax_lm, softmax_to_lion
from .hub import ContinuationHubInterface, DataBpeHub
from .lion_options import (UNBOUNDED_POSITIONS, LionOptions, boolean_optional, checkpointed, fix_lion_flags,
                           lion_attention_kwargs, lion_positions, model_name_arch, refuse_softmax_only_options,
                           set_unset)

logger = logging.getLogger(__name__)


@dataclass
class LionLMConfig(LionOptions):
    activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = field(
        default="gelu", metadata={"help": "activation function of the feed-forward blocks"})
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout after the FFN activation"})
    decoder_embed_dim: Optional[int] = field(default=None,
        metadata={"help": "decoder embedding dimension (default: the arch's; 512 for lion_lm)"})
    decoder_ffn_embed_dim: Optional[int] = field(default=None,
        metadata={"help": "decoder embedding dimension for FFN (default: the arch's; 2048 for lion_lm)"})
    decoder_layers: Optional[int] = field(default=None,
        metadata={"help": "num decoder layers (default: the arch's; 6 for lion_lm)"})
    decoder_attention_heads: Optional[int] = field(default=None,
        metadata={"help": "num decoder attention heads (default: the arch's; 8 for lion_lm)"})
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "share decoder input and output embeddings"})
    no_scale_embedding: bool = field(default=False, metadata={"help": "do not scale embeddings by sqrt(dim)"})
    layernorm_embedding: bool = field(default=False, metadata={"help": "a LayerNorm on the (positioned) embeddings"})
    # None: the arch decides (pre-norm); a checkpoint saved before this field existed is pre-norm too
    decoder_normalize_before: Optional[bool] = field(
        default=None, metadata={"help": "pre-norm layers and a final LayerNorm (the default); "
                                        "--no-decoder-normalize-before: post-norm layers and no final LayerNorm, as "
                                        "fairseq's --arch transformer_lm"})
    decoder_layerdrop: float = field(default=0.0, metadata={"help": "LayerDrop probability for decoder"})
    decoder_layers_to_keep: Optional[str] = field(
        default=None, metadata={"help": "which layers to *keep* when pruning, as a comma-separated list (fairseq "
                                        "prunes a LayerDrop-trained checkpoint's layers to these on load)"})
    no_decoder_final_norm: bool = field(
        default=False, metadata={"help": "no LayerNorm after the last pre-norm layer (fairseq's option of that name)"})
    tokens_per_sample: int = II("task.tokens_per_sample")
    max_target_positions: Optional[int] = II("task.max_target_positions")


class LionLMDecoder(FairseqIncrementalDecoder):
    """Token (and, for ``--lion-positions learned``, position) embeddings (``--layernorm-embedding``: then a
    LayerNorm), ``decoder_layers`` causal ``LionDecoderLayer``s, a final LayerNorm (pre-norm layers without
    ``--no-decoder-final-norm``) and the output projection. Submodule names are those of fairseq's
    ``TransformerDecoder``.

    ``forward(prev_output_tokens)``: ``(B, T)`` token ids -> logits ``(B, T, V)`` and
    ``{"attn": [None], "inner_states": [(T, B, C)] * (layers + 1)}``.
    """

    def __init__(self, cfg: Any, dictionary, embed_tokens: Optional[nn.Embedding] = None):
        super().__init__(dictionary)
        attention_kwargs = lion_attention_kwargs(cfg)
        dim = cfg.decoder_embed_dim
        self.padding_idx = dictionary.pad()
        if embed_tokens is None:
            embed_tokens = nn.Embedding(len(dictionary), dim, padding_idx=self.padding_idx)
            nn.init.normal_(embed_tokens.weight, mean=0, std=dim ** -0.5)
            nn.init.constant_(embed_tokens.weight[self.padding_idx], 0)
        self.embed_tokens = embed_tokens
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
        self.warned_at_limit = False
        if lion_positions(cfg) == "learned":
            self.max_target_positions = int(cfg.max_target_positions or cfg.tokens_per_sample)
            # position p of a real token is padding_idx + p (p >= 1), fairseq's convention
            self.embed_positions = nn.Embedding(self.max_target_positions + self.padding_idx + 1, dim,
                                                padding_idx=self.padding_idx)
            nn.init.normal_(self.embed_positions.weight, mean=0, std=dim ** -0.5)
            nn.init.constant_(self.embed_positions.weight[self.padding_idx], 0)
        else:
            # no length limit, unless --max-target-positions sets one, as it does for transformer_lm (fairseq then
            # skips longer samples and generation stops there)
            given = getattr(cfg, "max_target_positions", None)
            self.max_target_positions = int(given) if given else UNBOUNDED_POSITIONS
            self.embed_positions = None
        # a checkpoint saved before the option has none
        self.layernorm_embedding = LayerNorm(dim) if getattr(cfg, "layernorm_embedding", False) else None
        self.dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        layers = [checkpointed(
            LionDecoderLayer(dim, cfg.decoder_attention_heads, cfg.decoder_ffn_embed_dim, attention_kwargs,
                             dropout=cfg.dropout, activation_dropout=cfg.activation_dropout,
                             activation_fn=str(cfg.activation_fn), normalize_before=cfg.decoder_normalize_before),
            cfg) for _ in range(cfg.decoder_layers)]
        layerdrop = getattr(cfg, "decoder_layerdrop", 0.0)  # a checkpoint saved before the option has none
        self.layers = LayerDropModuleList(layerdrop, layers) if layerdrop else nn.ModuleList(layers)
        # fairseq's rule: post-norm layers end normalised already
        final_norm = cfg.decoder_normalize_before and not cfg.no_decoder_final_norm
        self.layer_norm = LayerNorm(dim) if final_norm else None
        # what a checkpoint's weights cannot show
        self.unseen = (f"{'pre' if cfg.decoder_normalize_before else 'post'}-norm layers "
                       f"{'with' if final_norm else 'without'} a final LayerNorm, activation {cfg.activation_fn}, "
                       f"{cfg.decoder_attention_heads} heads, embeddings scaled by {self.embed_scale:g}")
        self.output_projection = nn.Linear(dim, len(dictionary), bias=False)
        if cfg.share_decoder_input_output_embed:
            self.output_projection.weight = self.embed_tokens.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0, std=dim ** -0.5)

    def forward(self, prev_output_tokens: Tensor, encoder_out=None,
                incremental_state: Optional[IncrementalState] = None, features_only: bool = False,
                **unused) -> Tuple[Tensor, Dict[str, List[Optional[Tensor]]]]:
        x, extra = self.extract_features(prev_output_tokens, incremental_state=incremental_state)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def extract_features(self, prev_output_tokens: Tensor, encoder_out=None,
                         incremental_state: Optional[IncrementalState] = None,
                         **unused) -> Tuple[Tensor, Dict[str, List[Optional[Tensor]]]]:
        """prev_output_tokens: ``(B, T)``. Returns features ``(B, T', C)`` and the extra dict, where
        ``T' = 1`` for a decoding step after the prefill and ``T' = T`` otherwise."""
        tokens = prev_output_tokens
        stepping = incremental_state is not None and len(self.layers) > 0 and bool(
            self.layers[0].self_attn.decoding_state(incremental_state))
        if stepping:  # every earlier token is already in the layers' state (S, z), the only state kept
            tokens = tokens[:, -1:]
        pad = tokens.eq(self.padding_idx)
        seen = tokens.new_zeros(len(tokens))
        if stepping and self.embed_positions is not None:
            # fairseq's generator passes the whole prefix at every step, as its own learned positions need:
            # the real tokens before the new one place it
            if prev_output_tokens.size(1) < 2:
                raise ValueError("a decoding step of a model with learned positions takes the whole prefix, as "
                                 "fairseq's generator passes it (the last token is the new one): it was given "
                                 "the new token alone")
            seen = prev_output_tokens[:, :-1].ne(self.padding_idx).sum(1)

        x = self.embed_scale * embed_tokens_checked(self.embed_tokens, tokens)
        if self.embed_positions is not None:
            x = x + self.embed_positions(self._positions(pad, seen))
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x).transpose(0, 1)  # (T, B, C)

        # the mask costs a pass over the data; most training batches have no padding
        padding_mask = pad if pad.any() else None
        inner_states: List[Optional[Tensor]] = [x]
        for layer in self.layers:
            x = layer(x, padding_mask=padding_mask, incremental_state=incremental_state)
            inner_states.append(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)

        if incremental_state is not None:
            # the prefix's length bounds every row's count of real tokens: only the last steps count them (a
            # host sync)
            if self.max_target_positions < UNBOUNDED_POSITIONS and not self.warned_at_limit \
                    and prev_output_tokens.size(1) >= self.max_target_positions - 1 \
                    and int(prev_output_tokens.ne(self.padding_idx).sum(1).max()) >= self.max_target_positions - 1:
                # fairseq's generator ends every sequence one token short of the model's positions, silently
                self.warned_at_limit = True
                bound, beyond = self.length_bound
                logger.warning(f"decoding reached the model's {self.max_target_positions} {bound}: fairseq's "
                               f"generator ends each sequence there, whatever --max-len-b asks; to go further, "
                               f"{beyond}")
        # SequenceGenerator reads "attn"; LION has no attention matrix to show
        return x, {"attn": [None], "inner_states": inner_states}

    @property
    def length_bound(self) -> Tuple[str, str]:
        """What bounds the length (``max_target_positions``), and how to go further: for the messages that
        meet the bound."""
        if self.embed_positions is not None:
            return f"learned positions ({LEARNED_POSITIONS})", PAST_LEARNED_POSITIONS
        return ("positions (its --max-target-positions)",
                "load it with a larger max_target_positions (--model-overrides, or the hub's keyword): it has no "
                "positions to run out of")

    def _positions(self, pad: Tensor, seen: Tensor) -> Tensor:
        """Position ids ``(B, T)``: ``padding_idx + p`` for the p-th real token of each sentence
        (counting the ``seen`` ones before), ``padding_idx`` at padding; left padding is skipped."""
        real = (~pad).long()
        positions = (seen[:, None] + real.cumsum(1)) * real + self.padding_idx
        longest = int(positions.max()) - self.padding_idx if positions.numel() else 0
        # one past them is what --add-bos-token makes of a --tokens-per-sample sample
        bos = (f", or train with --max-target-positions {longest} (--add-bos-token makes each sample one token longer "
               "than --tokens-per-sample)" if longest == self.max_target_positions + 1 else "")
        # fairseq-eval-lm reads each block with its context window: --tokens-per-sample bounds both
        evaluated = (f"fairseq-eval-lm: --tokens-per-sample {self.max_target_positions} or less, which counts "
                     "--context-window's tokens too")
        check_learned_positions(longest, self.max_target_positions, shorter=f"shorter inputs ({evaluated}){bos}",
                                set_by="--max-target-positions / --tokens-per-sample")
        return positions

    def output_layer(self, features: Tensor) -> Tensor:
        """features ``(B, T, C)`` -> logits ``(B, T, V)``."""
        return self.output_projection(features)

    def max_positions(self) -> int:
        return self.max_target_positions


@register_model("lion_lm", dataclass=LionLMConfig)
class LionLanguageModel(ClearLoadErrors, DataBpeHub, FairseqLanguageModel):
    """A causal LION language model for ``--task language_modeling``; ``from_pretrained`` gives fairseq's
    ``sample``/``generate`` with lengths counted after the prompt (``ContinuationHubInterface``)."""

    hub_interface = ContinuationHubInterface

    @classmethod
    def add_args(cls, parser) -> None:
        super().add_args(parser)
        fix_lion_flags(parser)
        refuse_softmax_only_options(parser)
        boolean_optional(parser, "--decoder-normalize-before")

    def upgrade_state_dict_named(self, state_dict: Dict[str, Tensor], name: str) -> None:
        """A softmax ``transformer_lm``'s weights made this model's (``models/convert.py``): what fairseq runs
        before every strict load, so ``--finetune-from-model transformer_lm.pt`` and ``--restore-file`` with
        ``--reset-*`` start LION from it. What the weights cannot show is logged: it must be the teacher's."""
        super().upgrade_state_dict_named(state_dict, name)
        prefix = name + "." if name else ""
        if not is_softmax_lm(state_dict, prefix):
            check_ties(self, state_dict, prefix, LANGUAGE_MODEL)
            return
        learned = prefix + "decoder.embed_positions.weight" in state_dict
        softmax_to_lion(self, state_dict, prefix, LANGUAGE_MODEL, unseen=self.decoder.unseen)
        if not learned and self.decoder.embed_positions is None:
            logger.info("lion: the checkpoint has no learned positions: its sinusoidal ones (fairseq's default), "
                        "if any, have no weights and are dropped; this LION model has none")

    @classmethod
    def build_model(cls, cfg: Any, task) -> "LionLanguageModel":
        lion_lm_base(cfg)
        if getattr(cfg, "decoder_layers_to_keep", None):  # as fairseq's TransformerDecoder: the kept layers only
            cfg.decoder_layers = len(str(cfg.decoder_layers_to_keep).split(","))
        if cfg.decoder_embed_dim % cfg.decoder_attention_heads:
            raise ValueError(f"--decoder-embed-dim {cfg.decoder_embed_dim} must be divisible by "
                             f"--decoder-attention-heads {cfg.decoder_attention_heads}")
        try:
            return cls(LionLMDecoder(cfg, task.target_dictionary))
        except ValueError as e:  # a bad --lion-* combination: say so at start-up, with the option's name
            raise ValueError(f"lion_lm: {e}") from None


def lion_lm_base(args: Any) -> None:
    """Defaults of every field (transformer_lm size, LION-S): ``--arch lion_lm``; the named archs set
    theirs first."""
    check_task(args)
    set_unset(args, dict(
        lion_variant="s",
        lion_form="chunk",
        lion_chunk_size=64,
        lion_normalize=True,
        lion_norm_after=False,
        lion_gate_temperature=1.0,
        lion_output_gate=False,
        lion_short_conv=0,
        activation_fn="gelu",
        dropout=0.1,
        activation_dropout=0.0,
        decoder_embed_dim=512,
        decoder_ffn_embed_dim=2048,
        decoder_layers=6,
        decoder_attention_heads=8,
        share_decoder_input_output_embed=False,
        no_scale_embedding=False,
        layernorm_embedding=False,
        decoder_normalize_before=True,
        no_decoder_final_norm=False,
    ))


def _size(args: Any, layers: int, dim: int, heads: int, ffn: int) -> None:
    set_unset(args, dict(decoder_layers=layers, decoder_embed_dim=dim, decoder_attention_heads=heads,
                         decoder_ffn_embed_dim=ffn))


# what the ``_plus`` archs add to the paper's model, chosen by ``python -m lion_fairseq.benchmark.quality``
# (docs/quality.md: what each addition is worth)
PLUS_LEVERS = dict(lion_short_conv=4, lion_output_gate=True, lion_gate_temperature=8.0)


def _arch(name: str, variant: str, tiny: bool, plus: bool = False) -> None:
    def arch(args: Any) -> None:
        set_unset(args, dict(lion_variant=variant))
        if plus:
            set_unset(args, PLUS_LEVERS)
        if tiny:
            _size(args, 2, 128, 2, 512)
        else:
            _size(args, 6, 512, 8, 2048)
        lion_lm_base(args)

    arch.__name__ = arch.__qualname__ = name
    arch.__doc__ = (f"LION-{variant.upper()} causal LM{' with ' + str(PLUS_LEVERS) if plus else ''}, "
                    f"{'tiny (2 x 128, 2 heads)' if tiny else 'transformer_lm size (6 x 512, 8 heads)'}.")
    register_model_architecture("lion_lm", name)(arch)


model_name_arch("lion_lm", lion_lm_base)
for _variant, _names in {"lit": ["lion_lit_lm"], "d": ["lion_d_lm", "lion_retnet_lm"], "s": ["lion_s_lm"]}.items():
    for _name in _names:
        _arch(_name, _variant, tiny=False)
    _arch(f"lion_{_variant}_lm_tiny", _variant, tiny=True)
# the paper's LION-S plus the levers of PLUS_LEVERS (the names above keep the paper's model)
_arch("lion_s_lm_plus", "s", tiny=False, plus=True)
_arch("lion_s_lm_plus_tiny", "s", tiny=True, plus=True)
