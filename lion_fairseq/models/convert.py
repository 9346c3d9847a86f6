"""A softmax model's checkpoint as a LION model's, the fairseq way (``upgrade_state_dict_named``, which every
load runs before its strict check: ``--finetune-from-model``, ``--restore-file`` with ``--reset-*``, the
hub), and as a file (``python -m lion_fairseq.convert``):

- fairseq's RoBERTa into ``lion_roberta`` (``lion_lit``, ``lion_d``, ``lion_s`` ...): ``ROBERTA``;
- fairseq's ``transformer_lm`` into ``lion_lm`` (``lion_s_lm`` ...): ``LANGUAGE_MODEL``;
- fairseq's ``transformer`` (translation) into ``lion_transformer`` (``lion_s_transformer`` ...):
  ``TRANSLATION``.

What happens to the teacher's tensors:

- copied as they are: token embeddings, every q/k/v/out projection, FFN, LayerNorm, output projections, the
  LM head and any classification head (RoBERTa's head reconciliation applies), a translation model's
  cross-attention (into fairseq's softmax attention, or with ``--lion-cross-attention linear`` into the
  linear one, whose q/k/v/out projections have the same names and shapes). A combined ``in_proj_weight``
  of older fairseq is split into q, k, v first, as fairseq's own attention does;
- learned positions: kept where the LION model has them (LION-LIT's default in the encoder; ``--lion-positions
  learned`` in the LM), their first rows when it has fewer (a smaller ``--max-positions`` /
  ``--tokens-per-sample``); dropped, with a logged line, where it has none (LION-D/S). A model with more
  positions than the teacher is refused, naming the option. A translation model keeps fairseq's positions
  (sinusoidal by default) as its teacher had them;
- dropped, with a logged line: fairseq's ``version`` buffers and anything else the LION model lacks and
  does not need;
- added by rule: every gate starts at ``sigmoid(GATE_LOGIT)`` = 0.9975, a memory of about 400 tokens, the
  same for every head and token (LION-D's logits; LION-S's projection with zero weights and that bias, so
  the gates become selective only as it learns): step 0 is LION-LIT with a long memory. Any other LION
  parameter (an output gate, a short convolution, a LayerNorm after the heads) keeps the new model's own
  initialisation (the convolution's is the identity).

Refused before torch's strict load, with the option to pass: a depth or a tensor shape that differs; a
structure the LION model lacks or has beyond the teacher's (a final LayerNorm, an embedding LayerNorm,
learned positions); embeddings that the LION model ties and the teacher did not; and what LION cannot
represent (adaptive input or softmax, fairseq's ``project_in_dim``/``project_out_dim``), saying why.
Head counts, the activation and pre- or post-norm layers are not in the weights: they are the LION model's
options, which must be the teacher's (``python -m lion_fairseq.convert`` reads them from the checkpoint)."""
import logging
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

GATE_LOGIT = 6.0

# what only LION has: the parameters of its gates, levers and norms after attention
LION_OWN = r"self_attn\.(gate_logit|gate_proj\.|head_norm\.|out_gate\.|conv_weight)|encoder_attn\.head_norm\."

# a teacher's tensors that no LION model can take, and why (checked before the layout's own reasons)
UNREPRESENTABLE = (
    (r"project_in_dim\.|project_out_dim\.",
     "the teacher's --decoder-input-dim / --decoder-output-dim differ from its --decoder-embed-dim (fairseq's "
     "transformer_lm defaults both to 512 whatever the width) and LION has no projection between them: only a "
     "teacher trained with both equal to its --decoder-embed-dim converts"),
    (r"adaptive_softmax\.|embed_tokens\.embeddings\.",
     "the teacher has adaptive input or softmax (--adaptive-input, --adaptive-softmax-cutoff), and LION has one "
     "embedding table and one output projection: only a teacher without them converts"),
)

Patterns = Tuple[Tuple[str, str], ...]


@dataclass(frozen=True)
class Layout:
    """How one kind of softmax checkpoint maps onto its LION model. Every pattern is searched in a tensor's
    name without the model's prefix; in a list of ``(pattern, text)`` the first match speaks."""
    stacks: Patterns          # (prefix of a layer stack, the option that sets its depth)
    shape_options: Patterns   # (pattern, the option that sets such a tensor's shape); the first is the
                              # dictionary's, whose tensors have one row per word
    droppable: str            # the teacher's tensors this LION model may drop
    structure: str            # the options that shape the architecture beyond the attention
    untie: str                # what to pass when the model ties tensors that the checkpoint keeps apart
    tie: str                  # what to pass when the teacher ties tensors that the model keeps apart
    extra: Patterns = ()      # (pattern, why and what to pass) for a tensor the checkpoint has, the model not
    missing: Patterns = ()    # likewise for a tensor the model has, the checkpoint not


DICTIONARY = ("the dictionary (binarise the data with the teacher's dict.txt: fairseq-preprocess --srcdict "
              "<teacher>/dict.txt)")

ROBERTA = Layout(
    stacks=(("encoder.sentence_encoder.", "--encoder-layers"),),
    shape_options=((r"embed_tokens|lm_head\.(weight|bias)$", DICTIONARY),
                   (r"embed_positions", "--max-positions"),
                   (r"fc1\.|fc2\.", "--encoder-ffn-embed-dim"),
                   (r"classification_heads", "--num-classes"),
                   (r".", "--encoder-embed-dim")),
    droppable=r"(^|\.)version$|embed_positions\.|_float_tensor$",
    structure="pass the teacher's --encoder-normalize-before, --layernorm-embedding or --untie-weights-roberta",
    untie="they were trained with --untie-weights-roberta (tied, one would load over the other): pass "
          "--untie-weights-roberta",
    tie="drop --untie-weights-roberta",
)

LANGUAGE_MODEL = Layout(
    stacks=(("decoder.", "--decoder-layers"),),
    shape_options=((r"embed_tokens|output_projection", DICTIONARY),
                   (r"embed_positions", "--tokens-per-sample (and --max-target-positions, if the teacher set it)"),
                   (r"fc1\.|fc2\.", "--decoder-ffn-embed-dim"),
                   (r".", "--decoder-embed-dim")),
    droppable=r"(^|\.)version$|embed_positions\.|_float_tensor$",
    structure="pass the teacher's --decoder-normalize-before / --no-decoder-normalize-before, "
              "--no-decoder-final-norm and --layernorm-embedding",
    untie="drop --share-decoder-input-output-embed: the checkpoint's input and output embeddings are separate",
    tie="pass --share-decoder-input-output-embed",
    extra=((r"^decoder\.layer_norm\.",
            "the teacher is pre-norm with a final LayerNorm: pass --decoder-normalize-before (the default) "
            "without --no-decoder-final-norm"),
           (r"layernorm_embedding\.", "the teacher has a LayerNorm on its embeddings: pass --layernorm-embedding")),
    missing=((r"^decoder\.layer_norm\.",
              "the teacher has no final LayerNorm: it is post-norm (fairseq's --arch transformer_lm without "
              "--decoder-normalize-before: pass --no-decoder-normalize-before) or pre-norm trained with "
              "--no-decoder-final-norm (pass that)"),
             (r"layernorm_embedding\.", "the teacher has no LayerNorm on its embeddings: drop --layernorm-embedding"),
             (r"embed_positions\.weight",
              "the teacher has no learned positions (fairseq's sinusoidal ones have no weights, and LION has no "
              "such kind): pass --lion-positions none, or start from a teacher trained with --decoder-learned-pos")),
)

TRANSLATION = Layout(
    stacks=(("encoder.", "--encoder-layers"), ("decoder.", "--decoder-layers")),
    shape_options=((r"embed_tokens|output_projection",
                    "the dictionaries (binarise the data with the teacher's dict.<lang>.txt: fairseq-preprocess "
                    "--srcdict/--tgtdict, or --joined-dictionary as the teacher)"),
                   (r"^encoder\.embed_positions", "--max-source-positions"),
                   (r"^decoder\.embed_positions", "--max-target-positions"),
                   (r"^encoder\..*(fc1|fc2)\.", "--encoder-ffn-embed-dim"),
                   (r"^decoder\..*(fc1|fc2)\.", "--decoder-ffn-embed-dim"),
                   (r"^encoder\.", "--encoder-embed-dim"),
                   (r".", "--decoder-embed-dim")),
    # positions are fairseq's on both sides, so learned ones are never dropped
    droppable=r"(^|\.)version$|_float_tensor$",
    structure="pass the teacher's --encoder-normalize-before, --decoder-normalize-before, --no-decoder-final-norm, "
              "--layernorm-embedding, --encoder-learned-pos, --decoder-learned-pos or --no-token-positional-embeddings",
    untie="drop --share-all-embeddings / --share-decoder-input-output-embed: the checkpoint's embeddings are "
          "separate",
    tie="pass the teacher's --share-all-embeddings or --share-decoder-input-output-embed",
    extra=((r"embed_positions\.weight",
            "the teacher has learned positions: pass --encoder-learned-pos and --decoder-learned-pos as it was "
            "trained (or --lion-positions learned for both)"),),
    missing=((r"embed_positions\.weight",
              "the teacher's positions are sinusoidal (no weights): drop --lion-positions learned and "
              "--encoder-learned-pos / --decoder-learned-pos, so the model keeps fairseq's positions as its teacher"),),
)


def _split_in_proj(state_dict: Dict[str, Tensor]) -> None:
    """Older fairseq attention kept q, k, v as one ``in_proj_weight`` ``(3C, C)``: split it as fairseq's
    ``MultiheadAttention.upgrade_state_dict_named`` does."""
    for key in [k for k in state_dict if k.endswith("in_proj_weight") or k.endswith("in_proj_bias")]:
        base, kind = key.rsplit("in_proj_", 1)
        for name, part in zip(("q_proj.", "k_proj.", "v_proj."), state_dict.pop(key).chunk(3, dim=0)):
            state_dict[base + name + kind] = part


def _first(patterns: Patterns, name: str) -> Optional[str]:
    return next((text for pattern, text in patterns if re.search(pattern, name)), None)


def unrepresentable(names: Iterable[str]) -> Optional[str]:
    """Why no LION model takes a checkpoint with tensors of these names (``UNREPRESENTABLE``); None if none."""
    return next(filter(None, (_first(UNREPRESENTABLE, name) for name in names)), None)


def _layers(keys, stack: str) -> int:
    return len({m.group(1) for k in keys for m in [re.search("^" + re.escape(stack) + r"layers\.(\d+)\.", k)] if m})


def is_softmax_roberta(state_dict: Dict[str, Tensor], prefix: str = "") -> bool:
    """A fairseq RoBERTa's weights, before RoBERTa's own renaming of ``decoder.`` to ``encoder.``: today's
    encoder is fairseq's ``TransformerEncoder``, whose ``version`` buffer no LION encoder has; older fairseq's
    (``TransformerSentenceEncoder``: ``roberta.base`` and ``roberta.large`` as released, with combined
    ``in_proj`` weights) has no such buffer, but its weights lie under ``decoder.sentence_encoder.``, where no
    LION checkpoint's do."""
    return (prefix + "encoder.sentence_encoder.version" in state_dict
            or any(k.startswith(prefix + "decoder.sentence_encoder.") for k in state_dict))


def is_softmax_lm(state_dict: Dict[str, Tensor], prefix: str = "") -> bool:
    """A fairseq ``transformer_lm``'s weights: its decoder is fairseq's ``TransformerDecoder``, whose
    ``version`` buffer the LION LM's decoder lacks."""
    return prefix + "decoder.version" in state_dict


def is_softmax_transformer(model: nn.Module, state_dict: Dict[str, Tensor], prefix: str = "") -> bool:
    """Weights of fairseq's ``transformer`` (or of a LION-LIT one without levers: the two have the same
    tensors, and the same rule starts LION from either) for a LION translation ``model``: the model has gate
    or lever parameters and the checkpoint none, or the checkpoint's attention is older fairseq's combined
    ``in_proj``. Both encoders have a ``version`` buffer, so this is what tells them apart."""
    model_gated = any(re.search(LION_OWN, k) for k in model.state_dict())
    checkpoint_gated = any(re.search(LION_OWN, k) for k in state_dict if k.startswith(prefix))
    combined = any(k.startswith(prefix) and "self_attn.in_proj_" in k for k in state_dict)
    return (model_gated and not checkpoint_gated) or combined


def softmax_to_lion(model: nn.Module, state_dict: Dict[str, Tensor], prefix: str = "",
                    layout: Layout = ROBERTA, unseen: Optional[str] = None) -> None:
    """Make a softmax model's ``state_dict`` (keys under ``prefix``) the state dict of the LION ``model``,
    in place, by the rules of this module's docstring; logs what it dropped and added, and ``unseen``: the
    structure the weights cannot show (heads, norms, activation), which the model took from its options."""
    _split_in_proj(state_dict)
    own = {prefix + k: v for k, v in model.state_dict().items()}
    _check_sizes(state_dict, own, prefix, layout)
    dropped = _drop_extra(state_dict, own, prefix, layout)
    _fit_shapes(state_dict, own, prefix, layout)
    added = _add_lion_own(state_dict, own, prefix, layout)
    check_ties(model, state_dict, prefix, layout)
    _warn_untied(model, state_dict, prefix, layout)
    if dropped:
        logger.info(f"lion: from the softmax checkpoint, dropped what this LION model has no use for: "
                    f"{_summary(dropped)}")
    if added:
        logger.info(f"lion: added what LION has and the checkpoint lacks (gates at sigmoid({GATE_LOGIT:g}), the "
                    f"rest as initialised): {_summary(added)}")
    if unseen:  # it must be the teacher's
        logger.info(f"lion: not in the weights, so taken from this model's options (pass the teacher's where they "
                    f"differ): {unseen}")


def _stack_sizes(state_dict: Dict[str, Tensor], stack: str) -> Dict[str, Optional[int]]:
    """A layer stack's depth, width and FFN width, read from its weights (None where they do not say)."""
    fc1 = state_dict.get(stack + "layers.0.fc1.weight")
    return {"layers": _layers(state_dict, stack), "width": None if fc1 is None else fc1.shape[1],
            "FFN": None if fc1 is None else fc1.shape[0]}


def _check_sizes(state_dict: Dict[str, Tensor], own: Dict[str, Tensor], prefix: str, layout: Layout) -> None:
    """Every depth and width in which the teacher's layer stacks differ from the model's, refused at once with
    the teacher's values (one option per failed run was how a user found them)."""
    wrong, heads = [], []
    for stack, depth in layout.stacks:
        side = depth[2:].split("-")[0]  # encoder, decoder
        teacher, student = _stack_sizes(state_dict, prefix + stack), _stack_sizes(own, prefix + stack)
        for fact, option in (("layers", depth), ("width", f"--{side}-embed-dim"), ("FFN", f"--{side}-ffn-embed-dim")):
            if None not in (teacher[fact], student[fact]) and teacher[fact] != student[fact]:
                wrong.append((f"{side} {fact} {teacher[fact]} (this model {student[fact]})",
                              f"{option} {teacher[fact]}"))
                if fact == "width":
                    heads.append(f"--{side}-attention-heads (a divisor of {teacher[fact]})")
    if wrong:
        raise ValueError("the checkpoint's sizes are not this model's: " + ", ".join(what for what, _ in wrong)
                         + ": pass " + " ".join(option for _, option in wrong)
                         + (f", and the teacher's {' and '.join(heads)}, which its weights do not show"
                            if heads else ""))


def _drop_extra(state_dict: Dict[str, Tensor], own: Dict[str, Tensor], prefix: str, layout: Layout) -> List[str]:
    """Deletes the checkpoint's tensors that the model lacks and may drop; returns their names. Any other
    such tensor is refused, with why."""
    dropped = []
    for key in [k for k in state_dict if k.startswith(prefix) and k not in own]:
        name = key[len(prefix):]
        if not re.search(layout.droppable, name):
            why = (_first(UNREPRESENTABLE + layout.extra, name)
                   or f"its architecture differs beyond the attention ({layout.structure})")
            raise ValueError(f"the checkpoint has {name}, which this model lacks: {why}")
        dropped.append(name)
        del state_dict[key]
    return dropped


def _fit_shapes(state_dict: Dict[str, Tensor], own: Dict[str, Tensor], prefix: str, layout: Layout) -> None:
    """Learned positions cropped to the model's fewer rows; any other shape that differs is refused,
    naming the option that sets it."""
    for key in [k for k in state_dict if k in own]:
        have, want = tuple(state_dict[key].shape), tuple(own[key].shape)
        if have == want:
            continue
        name = key[len(prefix):]
        if "embed_positions" in key and have[0] > want[0] and have[1:] == want[1:]:
            logger.info(f"lion: {name}: the teacher's first {want[0]} of {have[0]} learned positions")
            state_dict[key] = state_dict[key][:want[0]].clone()
            continue
        options = layout.shape_options
        if have[0] == want[0] and re.search(options[0][0], name):  # as many words: the width differs
            options = options[1:]
        raise ValueError(f"{name} is {have} in the checkpoint and {want} in this model: "
                         f"set {_first(options, name)} as the teacher has it")


def _add_lion_own(state_dict: Dict[str, Tensor], own: Dict[str, Tensor], prefix: str, layout: Layout) -> List[str]:
    """Adds what only LION has (gates by the rule, the rest as the model initialised it); returns their
    names. Any other tensor the checkpoint lacks is refused, with why."""
    added = []
    for key, value in own.items():
        if key in state_dict:
            continue
        name = key[len(prefix):]
        if not re.search(LION_OWN, name):
            why = _first(layout.missing, name) or f"its architecture differs beyond the attention ({layout.structure})"
            raise ValueError(f"the checkpoint lacks {name}, which this model has: {why}")
        added.append(name)
        if name.endswith("gate_logit") or name.endswith("gate_proj.bias"):
            state_dict[key] = torch.full_like(value, GATE_LOGIT)
        elif name.endswith("gate_proj.weight"):
            state_dict[key] = torch.zeros_like(value)
        else:
            state_dict[key] = value.clone()
    return added


def check_ties(model: nn.Module, state_dict: Dict[str, Tensor], prefix: str, layout: Layout) -> None:
    """A parameter the model shares between two names (tied embeddings) loads whichever tensor comes last,
    silently: the checkpoint (a converted teacher's, or a LION model's trained untied) must hold one tensor
    under both names. A name it lacks is left to the strict load, which names it."""
    names: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for tied in (n for n in names.values() if len(n) > 1):
        tensors = [state_dict.get(prefix + n) for n in tied]
        if any(t is None for t in tensors):
            continue
        if not all(torch.equal(tensors[0], t) for t in tensors[1:]):
            raise ValueError(f"this model ties {' and '.join(tied)}, which differ in the checkpoint: {layout.untie}")


def _warn_untied(model: nn.Module, state_dict: Dict[str, Tensor], prefix: str, layout: Layout) -> None:
    """Tensors the teacher tied (saved as one storage under two names) that the model keeps apart load, but
    train as two, with more parameters than the teacher: said, since the teacher's options were meant."""
    separate = {prefix + name for name, _ in model.named_parameters()}  # one name per parameter
    names: Dict[Tuple[int, Tuple[int, ...]], List[str]] = {}
    for key, value in state_dict.items():
        if key in separate and value.numel():
            names.setdefault((value.data_ptr(), tuple(value.shape)), []).append(key[len(prefix):])
    for tied in (n for n in names.values() if len(n) > 1):
        logger.warning(f"lion: the teacher ties {' and '.join(tied)}, which this model trains apart: {layout.tie} "
                       "to keep them one tensor, as the teacher has them")


def _summary(names: List[str]) -> str:
    """Names with layer numbers collapsed: ``layers.*.self_attn.gate_proj.weight`` once, not per layer."""
    seen: Dict[str, None] = {}
    for n in names:
        seen.setdefault(re.sub(r"layers\.\d+\.", "layers.*.", n), None)
    return ", ".join(seen)
