"""The LION bidirectional encoder as a RoBERTa-compatible fairseq model (``lion_roberta``).

It trains with ``--task masked_lm --criterion masked_lm`` and fine-tunes with ``--task sentence_prediction
--restore-file <mlm checkpoint>`` exactly like RoBERTa: it is a ``RobertaModel`` subclass with RoBERTa's
LM head, classification heads and head reconciliation on load; only the encoder stack differs (LION
attention instead of softmax attention). Archs: ``lion_{lit,d,s}``, their ``_large`` and ``_tiny`` sizes,
and ``lion_retnet`` (= ``lion_d``). The config is a dataclass, so checkpoints reload under torch's
``weights_only`` default, and ``--model-overrides "{'lion_form': 'recurrent'}"`` switches the form.
"""
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from fairseq import utils
from fairseq.dataclass import ChoiceEnum
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import FairseqEncoder, register_model, register_model_architecture
from fairseq.models.roberta.hub_interface import RobertaHubInterface
from fairseq.models.roberta.model import RobertaLMHead, RobertaModel
from fairseq.modules import LayerDropModuleList, LayerNorm, PositionalEmbedding
from fairseq.modules.fairseq_dropout import FairseqDropout
from omegaconf import OmegaConf, open_dict
from torch import Tensor

from ..clear_errors import ClearLoadErrors, check_learned_positions, check_task, embed_tokens_checked
from ..modules.encoder_layer import LionEncoderLayer
from .convert import ROBERTA, check_ties, is_softmax_roberta, softmax_to_lion
from .hub import bpe_from_data, load_pretrained
from .lion_options import (UNBOUNDED_POSITIONS, LionOptions, arch_filling, boolean_optional, checkpointed,
                           fix_lion_flags, lion_attention_kwargs, lion_positions, model_name_arch,
                           refuse_softmax_only_options, set_unset, set_unset_from)

logger = logging.getLogger(__name__)


@dataclass
class LionEncoderConfig(LionOptions):
    encoder_layers: Optional[int] = field(default=None,
        metadata={"help": "num encoder layers (default: the arch's; 12 for lion_roberta)"})
    encoder_embed_dim: Optional[int] = field(default=None,
        metadata={"help": "encoder embedding dimension (default: the arch's; 768 for lion_roberta)"})
    encoder_ffn_embed_dim: Optional[int] = field(default=None,
        metadata={"help": "encoder embedding dimension for FFN (default: the arch's; 3072 for lion_roberta)"})
    encoder_attention_heads: Optional[int] = field(default=None,
        metadata={"help": "num encoder attention heads (default: the arch's; 12 for lion_roberta)"})
    encoder_normalize_before: bool = field(
        default=False, metadata={"help": "apply layernorm before each encoder block (pre-norm)"})
    layernorm_embedding: bool = field(
        default=True, metadata={"help": "layernorm on the embeddings, as RoBERTa (--no-layernorm-embedding to drop it)"})
    activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = field(
        default="gelu", metadata={"help": "activation function of the FFN and the LM head"})
    pooler_activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = field(
        default="tanh", metadata={"help": "activation function of the classification heads"})
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    attention_dropout: float = field(
        default=0.0, metadata={"help": "dropout on the attention output before the output projection "
                                       "(LION has no attention weights to drop)"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout probability after activation in FFN"})
    pooler_dropout: float = field(default=0.0, metadata={"help": "dropout probability in the classification heads"})
    encoder_layerdrop: float = field(default=0.0, metadata={"help": "LayerDrop probability for encoder"})
    encoder_layers_to_keep: Optional[str] = field(
        default=None, metadata={"help": "which layers to *keep* when pruning, as a comma-separated list (fairseq "
                                        "prunes a LayerDrop-trained checkpoint's layers to these on load)"})
    max_positions: Optional[int] = field(
        default=None, metadata={"help": "number of learned positions (default: the task's --tokens-per-sample); "
                                        "unused with --lion-positions none"})
    load_checkpoint_heads: bool = field(
        default=False, metadata={"help": "(re-)register and load heads when loading checkpoints"})
    untie_weights_roberta: bool = field(
        default=False, metadata={"help": "untie weights between embeddings and the LM head"})
    quant_noise_pq: float = field(default=0.0, metadata={"help": "PQ quantization noise of the classification heads"})
    quant_noise_pq_block_size: int = field(default=8, metadata={"help": "block size of that noise"})
    spectral_norm_classification_head: bool = field(
        default=False, metadata={"help": "spectral normalization on the classification head"})


def complete_encoder_config(cfg: Any, task, fill_defaults: Callable[[Any], None]) -> None:
    """At build time: the arch's defaults for what is unset, learned positions as many as the task's
    sequences, and a bad ``--lion-*`` option stopped here, with its name. Edits ``cfg`` in place."""
    with open_dict(cfg) if OmegaConf.is_config(cfg) else contextlib.nullcontext():
        fill_defaults(cfg)
        if getattr(cfg, "encoder_layers_to_keep", None):  # as RobertaEncoder: the kept layers only (not in LRA's)
            cfg.encoder_layers = len(str(cfg.encoder_layers_to_keep).split(","))
        if getattr(cfg, "max_positions", None) is None:  # an argparse Namespace lacks what the arch left out
            cfg.max_positions = task.max_positions()
    if cfg.encoder_embed_dim % cfg.encoder_attention_heads:  # an arch's heads kept at another width
        raise ValueError(f"--encoder-embed-dim {cfg.encoder_embed_dim} must be divisible by "
                         f"--encoder-attention-heads {cfg.encoder_attention_heads}: pass a head count that divides it")
    lion_attention_kwargs(cfg)


class LionSentenceEncoder(FairseqEncoder):
    """Token (and optional learned position) embeddings, then a stack of :class:`LionEncoderLayer`.
    Same submodule names and output dict as fairseq's ``TransformerEncoder``."""

    def __init__(self, cfg: Any, dictionary, embed_tokens: nn.Embedding):
        super().__init__(dictionary)
        embed_dim = cfg.encoder_embed_dim
        self.padding_idx = embed_tokens.padding_idx
        self.embed_tokens = embed_tokens
        self.embed_positions = (
            PositionalEmbedding(cfg.max_positions, embed_dim, self.padding_idx, learned=True)
            if lion_positions(cfg) == "learned" else None)
        self.layernorm_embedding = LayerNorm(embed_dim) if cfg.layernorm_embedding else None
        self.dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        attention = lion_attention_kwargs(cfg)
        layers = [checkpointed(
            LionEncoderLayer(embed_dim, cfg.encoder_attention_heads, cfg.encoder_ffn_embed_dim, attention,
                             dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
                             activation_dropout=cfg.activation_dropout, activation_fn=str(cfg.activation_fn),
                             normalize_before=cfg.encoder_normalize_before),
            cfg) for _ in range(cfg.encoder_layers)]
        self.layers = LayerDropModuleList(cfg.encoder_layerdrop, layers) if cfg.encoder_layerdrop > 0 \
            else nn.ModuleList(layers)
        # pre-norm leaves the residual stream unnormalised: one LayerNorm at the end, as fairseq does
        self.layer_norm = LayerNorm(embed_dim) if cfg.encoder_normalize_before else None
        # what a checkpoint's weights cannot show
        self.unseen = (f"{cfg.encoder_attention_heads} heads, {'pre' if cfg.encoder_normalize_before else 'post'}-norm "
                       f"layers, activation {cfg.activation_fn}")

    def every_layer(self) -> List[nn.Module]:
        """The layers, all of them: iterating fairseq's LayerDropModuleList (``--encoder-layerdrop``) in
        training mode skips some, as the forward wants and code that changes or pairs the layers does not."""
        return [self.layers[i] for i in range(len(self.layers))]

    def forward(self, src_tokens: Tensor, return_all_hiddens: bool = False, **unused) -> Dict[str, List[Tensor]]:
        """src_tokens: ``(B, T)``. Returns ``encoder_out`` ``[(T, B, C)]``, ``encoder_padding_mask``
        ``[(B, T)]`` and, with ``return_all_hiddens``, ``encoder_states`` (the embeddings and every
        layer's output, each ``(T, B, C)``)."""
        padding_mask = src_tokens.eq(self.padding_idx)
        x = embed_tokens_checked(self.embed_tokens, src_tokens)
        if self.embed_positions is not None:
            if src_tokens.size(1) > self.embed_positions.max_positions:  # only then count the real tokens
                check_learned_positions(int((~padding_mask).sum(1).max()), self.embed_positions.max_positions)
            # make_positions counts only real tokens: a right- or left-padded sentence gets the
            # positions it has alone
            x = x + self.embed_positions(src_tokens)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x)
        has_pads = bool(padding_mask.any())
        if has_pads:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        x = x.transpose(0, 1)  # B x T x C -> T x B x C
        states = [x] if return_all_hiddens else []
        for layer in self.layers:
            x = layer(x, encoder_padding_mask=padding_mask if has_pads else None)
            if return_all_hiddens:
                states.append(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
            if return_all_hiddens:
                states[-1] = x
        return {"encoder_out": [x], "encoder_padding_mask": [padding_mask], "encoder_states": states,
                "src_tokens": [], "src_lengths": []}

    def max_positions(self) -> int:
        return self.embed_positions.max_positions if self.embed_positions is not None else UNBOUNDED_POSITIONS


class LionRobertaEncoder(FairseqEncoder):
    """RoBERTa's encoder interface (``sentence_encoder`` + ``lm_head``) around a LION stack."""

    def __init__(self, cfg: Any, dictionary):
        super().__init__(dictionary)
        self.args = cfg
        embed_tokens = nn.Embedding(len(dictionary), cfg.encoder_embed_dim, dictionary.pad())
        self.sentence_encoder = LionSentenceEncoder(cfg, dictionary, embed_tokens)
        self.lm_head = RobertaLMHead(
            embed_dim=cfg.encoder_embed_dim, output_dim=len(dictionary), activation_fn=str(cfg.activation_fn),
            weight=None if cfg.untie_weights_roberta else embed_tokens.weight)

    def forward(self, src_tokens: Tensor, features_only: bool = False, return_all_hiddens: bool = False,
                masked_tokens: Optional[Tensor] = None, **unused):
        """src_tokens ``(B, T)`` -> logits ``(B, T, V)`` (or ``(n_masked, V)`` with masked_tokens), or
        features ``(B, T, C)`` when ``features_only``; and ``{"inner_states": [(T, B, C)] or None}``."""
        x, extra = self.extract_features(src_tokens, return_all_hiddens=return_all_hiddens)
        if not features_only:
            x = self.output_layer(x, masked_tokens=masked_tokens)
        return x, extra

    def extract_features(self, src_tokens: Tensor, return_all_hiddens: bool = False, **unused):
        out = self.sentence_encoder(src_tokens, return_all_hiddens=return_all_hiddens)
        features = out["encoder_out"][0].transpose(0, 1)
        return features, {"inner_states": out["encoder_states"] if return_all_hiddens else None}

    def output_layer(self, features: Tensor, masked_tokens: Optional[Tensor] = None, **unused) -> Tensor:
        return self.lm_head(features, masked_tokens)

    def max_positions(self) -> int:
        return self.sentence_encoder.max_positions()


class _WhitespaceTokens:
    """The hub's ``bpe`` when the data has none: dictionary units are whitespace-separated words."""

    def encode(self, x: str) -> str:
        return " ".join(x.split())

    def decode(self, x: str) -> str:
        return x


class LionHubInterface(RobertaHubInterface):
    """RoBERTa's hub interface (``encode``, ``extract_features``, ``predict``, ``fill_mask``, ...) for
    LION encoders: with no BPE passed or named by the checkpoint, the data's sentencepiece model
    (``models/hub.py``), else whitespace-separated dictionary units."""

    def __init__(self, cfg, task, model, folders=()):
        super().__init__(cfg, task, model)
        bpe_from_data(self, [getattr(cfg.task, "data", None), *folders])
        if self.bpe is None:
            self.bpe = _WhitespaceTokens()

    def extract_features(self, tokens: torch.LongTensor, return_all_hiddens: bool = False) -> torch.Tensor:
        """RoBERTa's (``predict`` calls it), with learned positions' length limit (LION-LIT) saying what to
        do, and a warning, once, where dropout makes its outputs random."""
        check_learned_positions(tokens.size(-1), self.model.max_positions(),
                                shorter="a shorter input (<s> and </s> count)")
        if self.model.training and not getattr(self, "_said_training", False):
            # fairseq's RoBERTa hub starts in training mode, as does this one: a fine-tuning loop wants it,
            # while predictions made so differ from call to call and from fairseq-validate's
            rates = sorted({m.p for m in self.model.modules()
                            if isinstance(m, (FairseqDropout, nn.Dropout)) and m.p > 0})
            if rates:
                self._said_training = True
                logger.warning("the hub is in training mode, as from_pretrained returns it (fairseq's RoBERTa hub "
                               "too): dropout (p = %s) is on, so features and predictions change from call to "
                               "call; call hub.eval() before predicting, as RoBERTa's README does (training mode is "
                               "for fine-tuning)", ", ".join(f"{p:g}" for p in rates))
        return super().extract_features(tokens, return_all_hiddens)

    def predict(self, head: str, tokens: torch.LongTensor, return_logits: bool = False) -> torch.Tensor:
        """RoBERTa's, naming the heads there are where ``head`` is none of them (a bare KeyError)."""
        heads = getattr(self.model, "classification_heads", {})
        if head not in heads:
            raise KeyError(f"no classification head {head!r}: this model has {sorted(heads)} (fine-tuning with "
                           "--task sentence_prediction adds 'sentence_classification_head'; "
                           "register_classification_head adds one)")
        return super().predict(head, tokens, return_logits)

    def fill_mask(self, masked_input: str, topk: int = 5) -> List[Tuple[str, float, str]]:
        """Top-k fillers of the single ``<mask>`` in ``masked_input``: a list of (filled sentence,
        probability, token), most probable first. The probabilities are the model's over its whole
        vocabulary; the special symbols (``</s>``, ``<unk>``, ...) fill nothing and are passed over, so the
        list has ``topk`` entries. (fairseq's RoBERTa hub dropped them from the tokens but not from the
        probabilities: every token after one came with the probability of the rank above it.) With a BPE,
        the token is decoded as fairseq's hub gives it (with its leading space where it starts a word)."""
        if not isinstance(masked_input, str):  # fairseq's own takes one sentence too
            raise ValueError(f"fill_mask takes one sentence (a str) with one <mask>; got a {type(masked_input).__name__}"
                             ": call it once per sentence")
        if masked_input.count("<mask>") != 1:
            raise ValueError(f"fill_mask needs exactly one <mask> in its input; got {masked_input!r}")
        mask_idx = getattr(self.task, "mask_idx", None)
        if mask_idx is None:
            raise ValueError(f"fill_mask needs a masked-LM checkpoint (--task masked_lm); this one was trained "
                             f"with --task {getattr(getattr(self.cfg, 'task', None), '_name', '?')}, whose model "
                             "has no <mask> to fill")
        d = self.task.source_dictionary
        spans = " <mask> ".join(self.bpe.encode(span.rstrip()) for span in masked_input.split("<mask>")).strip()
        tokens = d.encode_line("<s> " + spans + " </s>", append_eos=False, add_if_not_exist=False).long()
        check_learned_positions(tokens.numel(), self.model.max_positions(),
                                shorter="a shorter input (<s> and </s> count)")
        at = int((tokens == mask_idx).nonzero(as_tuple=False)[0])
        with utils.model_eval(self.model), torch.no_grad():
            logits, _ = self.model(tokens.unsqueeze(0).to(device=self.device), features_only=False)
        prob = logits[0, at].float().softmax(dim=-1)
        fills = torch.ones_like(prob, dtype=torch.bool)
        fills[:d.nspecial] = False
        fills[mask_idx] = False
        values, index = prob.masked_fill(~fills, -1.0).topk(k=min(topk, int(fills.sum())))
        whitespace = isinstance(self.bpe, _WhitespaceTokens)
        out = []
        for p, i in zip(values.tolist(), index.tolist()):
            piece = d[i]
            if whitespace:
                out.append((masked_input.replace("<mask>", piece), p, piece))
                continue
            word = (" " if piece.startswith("\u2581") else "") + self.bpe.decode(piece)
            where = " <mask>" if " <mask>" in masked_input else "<mask>"
            out.append((masked_input.replace(where, word), p, word))
        return out


@register_model("lion_roberta", dataclass=LionEncoderConfig)
class LionRobertaModel(ClearLoadErrors, RobertaModel):
    """RoBERTa with LION attention: ``(B, T)`` tokens -> LM logits, features or classification logits.

    RoBERTa's ``__init__`` applies BERT's initialisation (normal(0, 0.02) on every Linear and Embedding),
    LION's projections and LION-S's gate included."""

    @classmethod
    def hub_models(cls) -> Dict[str, str]:
        return {}

    def upgrade_state_dict_named(self, state_dict: Dict[str, Tensor], name: str) -> None:
        """RoBERTa's renaming and head reconciliation, then a softmax RoBERTa's weights made this model's
        (``models/convert.py``): what fairseq runs before every strict load, so ``--finetune-from-model
        roberta.base/model.pt`` and ``--restore-file`` with ``--reset-*`` start LION from it. What the
        weights cannot show is logged: it must be the teacher's."""
        prefix = name + "." if name else ""
        softmax = is_softmax_roberta(state_dict, prefix)  # read before RoBERTa's renaming hides older layouts
        # a spectral-norm head (--spectral-norm-classification-head) stores out_proj.weight_orig, and RoBERTa's
        # head reconciliation reads out_proj.weight for its classes (a KeyError on every reload): lend it that
        lent = [k[:-len("_orig")] for k in state_dict if k.startswith(prefix + "classification_heads.")
                and k.endswith(".out_proj.weight_orig") and k[:-len("_orig")] not in state_dict]
        for k in lent:
            state_dict[k] = state_dict[k + "_orig"]
        super().upgrade_state_dict_named(state_dict, name)
        if getattr(self.args, "load_checkpoint_heads", False):  # RoBERTa keeps a head the task registered
            for head_name, head in self.classification_heads.items():
                out = state_dict.get(f"{prefix}classification_heads.{head_name}.out_proj.weight")  # lent too
                if out is not None and out.size(0) != head.out_proj.out_features:
                    raise ValueError(
                        f"the checkpoint's head {head_name!r} has {out.size(0)} classes and this run's has "
                        f"{head.out_proj.out_features} (--num-classes): --load-checkpoint-heads loads the "
                        f"checkpoint's head, so pass --num-classes {out.size(0)}, or leave --load-checkpoint-heads "
                        "out to start a new head.")
        for k in lent:
            state_dict.pop(k, None)
        if softmax:
            softmax_to_lion(self, state_dict, prefix, unseen=self.encoder.sentence_encoder.unseen)
        else:
            check_ties(self, state_dict, prefix, ROBERTA)

    @classmethod
    def add_args(cls, parser) -> None:
        gen_parser_from_dataclass(parser, LionEncoderConfig(), delete_default=True)
        fix_lion_flags(parser)
        refuse_softmax_only_options(parser)
        boolean_optional(parser, "--layernorm-embedding")

    @classmethod
    def build_model(cls, cfg: Any, task) -> "LionRobertaModel":
        complete_encoder_config(cfg, task, lion_roberta_base)
        return cls(cfg, LionRobertaEncoder(cfg, task.source_dictionary))

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, checkpoint_file: str = "model.pt",
                        data_name_or_path: str = ".", bpe: Optional[str] = None, **kwargs) -> LionHubInterface:
        """Load a checkpoint for inference: ``from_pretrained(checkpoint_dir, "checkpoint_best.pt",
        data_bin_dir)``. With ``bpe=None`` (default) and no BPE named by the checkpoint, inputs are encoded
        with the ``sentencepiece.bpe.model`` that ``preprocess.text`` wrote into the data folder (or one
        beside the checkpoint), else split on whitespace into dictionary units (word-level data).
        ``model_overrides``-style keys go in kwargs, e.g. ``lion_form="recurrent"``."""
        if bpe is not None:
            kwargs["bpe"] = bpe
        x = load_pretrained(cls, model_name_or_path, checkpoint_file, data_name_or_path, load_checkpoint_heads=True,
                            **kwargs)
        return LionHubInterface(x["args"], x["task"], x["models"][0], folders=[model_name_or_path])


# ---- architectures --------------------------------------------------------------------------------

SIZES = {
    "": dict(encoder_layers=12, encoder_embed_dim=768, encoder_ffn_embed_dim=3072, encoder_attention_heads=12),
    "_large": dict(encoder_layers=24, encoder_embed_dim=1024, encoder_ffn_embed_dim=4096, encoder_attention_heads=16),
    "_tiny": dict(encoder_layers=2, encoder_embed_dim=128, encoder_ffn_embed_dim=512, encoder_attention_heads=2),
}
VARIANT_OF_ARCH = {"lion_lit": "lit", "lion_d": "d", "lion_retnet": "d", "lion_s": "s"}


def lion_roberta_base(args: Any) -> None:
    """Fill every option the command line (or the arch) left unset (None): sizes and variant of
    ``lion_s``, everything else the config's default: ``--arch lion_roberta``."""
    check_task(args)
    set_unset(args, dict(SIZES[""], lion_variant="s"))
    # --max-positions is also sentence_prediction's option (default 512): a None here would replace that
    # default, and fairseq stops at its int field; left out, the model takes the task's at build time
    set_unset_from(args, LionEncoderConfig, exclude=("max_positions",))


model_name_arch("lion_roberta", lion_roberta_base)
for _prefix, _variant in VARIANT_OF_ARCH.items():
    for _suffix, _size in SIZES.items():
        if _prefix == "lion_retnet" and _suffix:
            continue  # lion_retnet is the paper's other name for the base-size lion_d only
        register_model_architecture("lion_roberta", _prefix + _suffix)(arch_filling(_variant, _size, lion_roberta_base))
