"""The LION options shared by every arch (``--lion-*``), as a fairseq dataclass."""
import argparse
import contextlib
import functools
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import ARCH_CONFIG_REGISTRY
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..modules.feature_maps import FEATURE_MAPS
from ..modules.lion_attention import DEFAULT_FEATURE_MAP, VARIANTS, check_lion_options
from ..ops import FORMS

LION_FORM_CHOICES = ChoiceEnum(list(FORMS))
LION_POSITION_CHOICES = ChoiceEnum(["learned", "none"])
LION_FEATURE_MAP_CHOICES = ChoiceEnum(list(FEATURE_MAPS))
LION_VARIANT_CHOICES = ChoiceEnum(list(VARIANTS))
DEFAULT_POSITIONS = {"lit": "learned", "d": "none", "s": "none"}
# max_positions() without position embeddings: nothing bounds the length, so report one no data set
# reaches; fairseq takes the min with the task's limit, and neither truncates nor filters for nothing
UNBOUNDED_POSITIONS = 10 ** 9


@dataclass
class LionOptions(FairseqDataclass):
    # None: the arch decides (fairseq-hydra-train merges dataclass defaults before the arch function
    # runs, so a concrete default here would override `model: {_name: lion_lit_lm_tiny}`)
    lion_variant: Optional[LION_VARIANT_CHOICES] = field(
        default=None, metadata={"help": "decay mask: lit (none), d (one learned decay per head), s (selective, "
                                        "per token); default: the arch's (s for the model names themselves)"})
    lion_form: LION_FORM_CHOICES = field(
        default="chunk", metadata={"help": "how attention is computed; all forms give the same outputs and "
                                           "can be switched on a trained checkpoint with --model-overrides"})
    lion_chunk_size: int = field(default=64, metadata={"help": "tokens per chunk of --lion-form chunk"})
    lion_feature_map: Optional[LION_FEATURE_MAP_CHOICES] = field(
        default=None, metadata={"help": "phi on queries and keys (default: elu for lit, silu_norm for d and s)"})
    lion_normalize: bool = field(
        default=True, metadata={"help": "divide each attention row by its sum (--no-lion-normalize to turn off)"})
    lion_norm_after: bool = field(default=False, metadata={"help": "LayerNorm over each head's output after attention"})
    lion_positions: Optional[LION_POSITION_CHOICES] = field(
        default=None, metadata={"help": "learned absolute positions or none (default: learned for lit, none for d and s)"})
    # the levers (gated linear attention's additions); None: the arch decides, which for the
    # archs named after the paper's models is the paper's model (1, off, 0)
    lion_gate_temperature: Optional[float] = field(
        default=None, metadata={"help": "log-gate = logsigmoid(logit) / this (GLA's tau; > 1 pulls the decays "
                                        "towards 1, longer memories); d and s only (default: the arch's, 1)"})
    lion_output_gate: Optional[bool] = field(
        default=None, metadata={"help": "multiply the head outputs by swish(W_g x) before the output projection "
                                        "(GLA, RetNet); --no-lion-output-gate to turn off (default: the arch's)"})
    lion_short_conv: Optional[int] = field(
        default=None, metadata={"help": "width N of a depthwise convolution over the projected q, k, v (causal "
                                        "in decoders, centred and odd in encoders); 0: none (default: the arch's)"})
    # fairseq's transformer_lm and transformer options, with their meaning
    checkpoint_activations: bool = field(
        default=False, metadata={"help": "checkpoint activations at each layer, which saves GPU memory usage "
                                         "at the cost of some additional compute"})
    offload_activations: bool = field(
        default=False, metadata={"help": "checkpoint activations at each layer, then save to cpu. Sets "
                                         "--checkpoint-activations."})


def boolean_optional(parser: argparse.ArgumentParser, option: str) -> None:
    """fairseq turns a bool field that defaults to True into a store_false flag of the same name (so
    ``--lion-normalize`` would turn normalisation off); make it the ``--x/--no-x`` pair users expect,
    default None so the arch decides."""
    action = parser._option_string_actions.get(option)
    if action is None:
        return
    action.container._remove_action(action)  # from its group and the parser's list, not their option table
    for opt in action.option_strings:
        parser._option_string_actions.pop(opt, None)
    action.container.add_argument(option, dest=action.dest, action=argparse.BooleanOptionalAction, default=None,
                                  help=action.help)


_POSITIONS = "LION's positions are chosen with --lion-positions"
_ADAPTIVE = "LION models embed and predict over the whole dictionary (no adaptive input or softmax): leave it out"
# options of fairseq's softmax models (roberta, transformer_lm, transformer) that a LION model has not, with
# what to pass instead: argparse alone said "unrecognized arguments", and nothing of why or what instead
SOFTMAX_ONLY_OPTIONS = {
    "--decoder-learned-pos": f"{_POSITIONS}: pass --lion-positions learned",
    "--encoder-learned-pos": f"{_POSITIONS}: pass --lion-positions learned",
    "--no-token-positional-embeddings": f"{_POSITIONS}: pass --lion-positions none",
    "--relu-dropout": "LION's FFN dropout is --activation-dropout: pass that",
    "--attention-dropout": "LION has no attention weights to drop, and this model does not drop its attention "
                           "output: leave it out (its dropouts are --dropout and --activation-dropout)",
    **dict.fromkeys(("--adaptive-input", "--adaptive-input-factor", "--adaptive-input-cutoff",
                     "--adaptive-softmax-cutoff", "--adaptive-softmax-dropout", "--adaptive-softmax-factor",
                     "--tie-adaptive-weights", "--tie-adaptive-proj"), _ADAPTIVE),
    "--cross-self-attention": "LION's decoder attends to the source through its own cross-attention "
                              "(--lion-cross-attention): leave it out",
    **dict.fromkeys(("--mha-heads-to-keep", "--mha-reg-scale-factor", "--ffn-blocks-to-remove",
                     "--ffn-reg-scale-factor"), "RoBERTa's structured pruning of softmax heads and FFN blocks is not "
                                                "on LION layers: leave it out"),
    **dict.fromkeys(("--quant-noise-pq", "--quant-noise-pq-block-size", "--quant-noise-scalar"),
                    "quantization noise is not on this model's LION layers: leave it out"),
    "--no-cross-attention": "a LION translation model's decoder always attends to the source: leave it out",
    **dict.fromkeys(("--decoder-input-dim", "--decoder-output-dim"),
                    "a LION decoder has one width, --decoder-embed-dim: leave it out"),
    **dict.fromkeys(("--character-embeddings", "--character-filters", "--character-embedding-dim",
                     "--char-embedder-highway-layers", "--char-inputs"),
                    "LION models embed the dictionary's tokens (no character embedder): leave it out"),
    **dict.fromkeys(("--base-layers", "--base-sublayers", "--base-shuffle"),
                    "BASE layers (experts) are not in LION models: leave it out"),
    **dict.fromkeys(("--scale-attn", "--scale-fc", "--scale-heads", "--scale-resids"),
                    "NormFormer's extra scalings are not on LION layers: leave it out"),
    **dict.fromkeys(("--encoder-xformers-att-config", "--decoder-xformers-att-config"),
                    "LION's attention is its own, not xformers' (--lion-form chooses how it is computed): leave it out"),
    "--merge-src-tgt-embed": "for one embedding table on both sides, binarise with fairseq-preprocess "
                             "--joined-dictionary and pass --share-all-embeddings",
    "--export": "LION models are not exported through TorchScript: leave it out",
    "--min-params-to-wrap": "fully sharded training (--ddp-backend fully_sharded) does not wrap LION's layers one by "
                            "one: leave it out",
}


class _Refused(argparse.Action):
    """An option of fairseq's softmax model that this LION model has not: stops the parser naming the fix."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {SOFTMAX_ONLY_OPTIONS[option_string]}")


def refuse_softmax_only_options(parser: argparse.ArgumentParser) -> None:
    """Make each of ``SOFTMAX_ONLY_OPTIONS`` that this model's parser lacks a hidden option that stops
    fairseq-train with what to pass instead. Unset, it adds nothing to the parsed arguments."""
    for option in SOFTMAX_ONLY_OPTIONS:
        if option not in parser._option_string_actions:
            parser.add_argument(option, action=_Refused, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def fix_lion_flags(parser: argparse.ArgumentParser) -> None:
    """``--lion-normalize/--no-lion-normalize``, ``--lion-output-gate/--no-lion-output-gate``."""
    boolean_optional(parser, "--lion-normalize")
    boolean_optional(parser, "--lion-output-gate")


def set_unset(args: Any, values: Dict[str, Any]) -> None:
    """Give each option the command line (or a more specific arch) left unset (absent or None) its value:
    the arch functions' rule, so that what a user typed always wins."""
    for name, value in values.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def arch_filling(variant: str, size: Dict[str, Any], base: Callable[[Any], None]) -> Callable[[Any], None]:
    """An arch function: ``size`` and the variant for every option left unset, then ``base`` for the rest."""
    def arch(args: Any) -> None:
        set_unset(args, dict(size, lion_variant=variant))
        base(args)
    return arch


def model_name_arch(model_name: str, base: Callable[[Any], None]) -> None:
    """Make ``--arch <model name>`` fill the options as ``base`` does. fairseq registers the name of every
    model with a dataclass as an arch of its own, whose function does nothing: options whose
    command-line default is None (the arch decides) stayed None, and fairseq-train stopped in hydra's
    "field 'model.lion_normalize' is not Optional". fairseq refuses a second registration of the name."""
    ARCH_CONFIG_REGISTRY[model_name] = base


def set_unset_from(args: Any, config_cls: type, exclude: Tuple[str, ...] = ()) -> None:
    """``set_unset`` with every field default of a dataclass config, but those named in ``exclude``."""
    set_unset(args, {f.name: f.default for f in fields(config_cls)
                     if not f.name.startswith("_") and f.name not in exclude})


def lion_attention_kwargs(cfg: Any) -> Dict[str, Any]:
    """Keyword arguments of ``LionAttention`` from a model config (dataclass, DictConfig or Namespace);
    raises ValueError naming the option when a value is wrong."""
    kwargs = dict(variant=_variant(cfg), form=str(cfg.lion_form), chunk_size=cfg.lion_chunk_size,
                  feature_map=_feature_map(cfg), normalize=bool(cfg.lion_normalize),
                  norm_after=bool(cfg.lion_norm_after), **lever_kwargs(cfg))
    check_lion_options(kwargs["variant"], kwargs["form"], kwargs["chunk_size"], kwargs["feature_map"],
                       kwargs["normalize"], kwargs["gate_temperature"], kwargs["short_conv"])
    return kwargs


def _variant(cfg: Any) -> str:
    return str(getattr(cfg, "lion_variant", None) or "s")


def _feature_map(cfg: Any) -> str:
    return str(getattr(cfg, "lion_feature_map", None) or DEFAULT_FEATURE_MAP.get(_variant(cfg), "elu"))


# the levers' LionAttention arguments by option
LEVERS = {"lion_gate_temperature": "gate_temperature", "lion_output_gate": "output_gate",
          "lion_short_conv": "short_conv"}


def built_value(cfg: Any, key: str) -> Any:
    """The value that a model built from ``cfg`` runs with for option ``key``: where the config holds None
    (the arch decided, or the checkpoint predates the option), the value building resolves it to. A
    translation config's unset ``lion_positions`` means fairseq's own positions (sinusoidal, or
    ``--encoder-learned-pos``): it stays None."""
    if key == "lion_feature_map":
        return _feature_map(cfg)
    if key in LEVERS:
        return lever_kwargs(cfg)[LEVERS[key]]
    if key == "lion_positions" and getattr(cfg, "encoder_learned_pos", None) is None:
        return lion_positions(cfg)
    return getattr(cfg, key, None)


def lever_kwargs(cfg: Any) -> Dict[str, Any]:
    """The levers' ``LionAttention`` arguments; a config without them (a checkpoint saved before they
    existed) or left at None gets the paper's model."""
    tau = getattr(cfg, "lion_gate_temperature", None)
    conv = getattr(cfg, "lion_short_conv", None)
    return dict(gate_temperature=1.0 if tau is None else float(tau),
                output_gate=bool(getattr(cfg, "lion_output_gate", None) or False),
                short_conv=0 if conv is None else int(conv))


def checkpointing(cfg: Any) -> bool:
    """Whether the layers recompute their activations in the backward (``--checkpoint-activations``, or
    ``--offload-activations``, which sets it, as in fairseq's ``transformer_lm``)."""
    return bool(getattr(cfg, "checkpoint_activations", False) or getattr(cfg, "offload_activations", False))


def checkpointed(layer: nn.Module, cfg: Any) -> nn.Module:
    """``layer``, made to recompute its forward in the backward instead of keeping its activations when
    ``checkpointing(cfg)``; with ``--offload-activations`` the input it keeps waits on the CPU. Like
    fairseq's ``checkpoint_wrapper`` it replaces ``forward`` on the instance, so parameter names, and the
    checkpoints that hold them, stay the same; unlike it, the recomputation replays autocast (``--amp``)
    as well as the dropout masks, so the gradients are those of the kept-activations run."""
    if checkpointing(cfg):
        layer.forward = functools.partial(_recomputed, layer.forward, bool(getattr(cfg, "offload_activations", False)))
    return layer


def _recomputed(forward: Callable, offload: bool, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # inference and validation keep nothing anyway
        return forward(*args, **kwargs)
    # the non-reentrant checkpoint saves its inputs outside its own hooks, so save_on_cpu moves them
    keep = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload \
        else contextlib.nullcontext()
    with keep:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def lion_positions(cfg: Any) -> str:
    return str(getattr(cfg, "lion_positions", None) or DEFAULT_POSITIONS[_variant(cfg)])
