"""A softmax model's checkpoint as a LION model's: fairseq's RoBERTa into ``lion_roberta`` (``lion_lit``,
``lion_d``, ``lion_s`` ...), the fairseq way (``upgrade_state_dict_named``, which every load runs before
its strict check: ``--finetune-from-model``, ``--restore-file`` with ``--reset-*``, the hub), and as a file
(``python -m lion_fairseq.convert``, ``main`` below).

What happens to the teacher's tensors:

- copied as they are: token embeddings, every q/k/v/out projection, FFN, LayerNorm, the LM head and any
  classification head (RoBERTa's head reconciliation applies). A combined ``in_proj_weight`` of older
  fairseq is split into q, k, v first, as fairseq's own attention does;
- learned positions: kept where the LION model has them (LION-LIT's default), their first rows when it has
  fewer (``--max-positions`` smaller than the teacher's); dropped, with a logged line, where it has none
  (LION-D/S). A model with more positions than the teacher is refused, naming ``--max-positions``;
- dropped, with a logged line: fairseq's ``version`` buffers and anything else the LION model lacks;
- added by rule: every gate starts at ``sigmoid(GATE_LOGIT)`` = 0.9975, a memory of about 400 tokens, the
  same for every head and token (LION-D's logits; LION-S's projection with zero weights and that bias, so
  the gates become selective only as it learns): step 0 is LION-LIT with a long memory. Any other LION
  parameter (an output gate, a short convolution, a LayerNorm after the heads) keeps the new model's own
  initialisation (the convolution's is the identity).

A tensor whose shape differs is refused before torch's strict load, naming the option that sets it.
Head counts are not in the weights: the archs ``lion_*`` and ``lion_*_large`` have ``roberta.base``'s and
``roberta.large``'s; otherwise pass the teacher's ``--encoder-attention-heads``."""
import logging
import re
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

GATE_LOGIT = 6.0

# which option sets a tensor's shape, by the first pattern its name matches
SHAPE_OPTIONS = [
    (r"embed_tokens|lm_head\.(weight|bias)$", "the dictionary (use the teacher's dict.txt: fairseq-preprocess "
                                             "--srcdict <teacher>/dict.txt)"),
    (r"embed_positions", "--max-positions"),
    (r"fc1\.|fc2\.", "--encoder-ffn-embed-dim"),
    (r"classification_heads", "--num-classes"),
    (r".", "--encoder-embed-dim"),
]


# what a softmax checkpoint may have that a LION model drops, and what only LION has
DROPPABLE = r"(^|\.)version$|embed_positions\.|_float_tensor$"
LION_OWN = r"self_attn\.(gate_logit|gate_proj\.|head_norm\.|out_gate\.|conv_weight)"
STRUCTURE_OPTIONS = ("pass the teacher's --encoder-normalize-before, --layernorm-embedding or "
                     "--untie-weights-roberta")


def _split_in_proj(state_dict: Dict[str, Tensor]) -> None:
    """Older fairseq attention kept q, k, v as one ``in_proj_weight`` ``(3C, C)``: split it as fairseq's
    ``MultiheadAttention.upgrade_state_dict_named`` does."""
    for key in [k for k in state_dict if k.endswith("in_proj_weight") or k.endswith("in_proj_bias")]:
        base, kind = key.rsplit("in_proj_", 1)
        for name, part in zip(("q_proj.", "k_proj.", "v_proj."), state_dict.pop(key).chunk(3, dim=0)):
            state_dict[base + name + kind] = part


def _option_for(key: str) -> str:
    return next(option for pattern, option in SHAPE_OPTIONS if re.search(pattern, key))


def _layers(keys, stack: str) -> int:
    return len({m.group(1) for k in keys for m in [re.search(re.escape(stack) + r"layers\.(\d+)\.", k)] if m})


def is_softmax_roberta(state_dict: Dict[str, Tensor], prefix: str = "") -> bool:
    """A fairseq RoBERTa's weights (after RoBERTa's own renaming of ``decoder.`` to ``encoder.``): its
    encoder is fairseq's ``TransformerEncoder``, whose ``version`` buffer no LION encoder has."""
    return prefix + "encoder.sentence_encoder.version" in state_dict


def softmax_to_lion(model: nn.Module, state_dict: Dict[str, Tensor], prefix: str = "",
                    stack: str = "encoder.sentence_encoder.", layers_option: str = "--encoder-layers") -> None:
    """Make a softmax model's ``state_dict`` (keys under ``prefix``) the state dict of the LION ``model``,
    in place, by the rules of this module's docstring; logs what it dropped and added."""
    _split_in_proj(state_dict)
    own = {prefix + k: v for k, v in model.state_dict().items()}
    teacher, student = _layers(state_dict, prefix + stack), _layers(own, prefix + stack)
    if teacher != student:
        raise ValueError(f"the checkpoint has {teacher} layers and this model {student}: pass {layers_option} "
                         f"{teacher} (the teacher's depth)")
    dropped: List[str] = []
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key not in own:
            name = key[len(prefix):]
            if not re.search(DROPPABLE, name):
                raise ValueError(f"the checkpoint has {name}, which this model lacks: its architecture differs "
                                 f"beyond the attention ({STRUCTURE_OPTIONS})")
            dropped.append(name)
            del state_dict[key]
            continue
        have, want = tuple(state_dict[key].shape), tuple(own[key].shape)
        if have == want:
            continue
        if "embed_positions" in key and have[0] > want[0] and have[1:] == want[1:]:
            logger.info(f"lion: {key[len(prefix):]}: the teacher's first {want[0]} of {have[0]} learned positions")
            state_dict[key] = state_dict[key][:want[0]].clone()
            continue
        raise ValueError(f"{key[len(prefix):]} is {have} in the checkpoint and {want} in this model: "
                         f"set {_option_for(key)} as the teacher has it")
    added: List[str] = []
    for key, value in own.items():
        if key in state_dict:
            continue
        name = key[len(prefix):]
        if not re.search(LION_OWN, name):
            raise ValueError(f"the checkpoint lacks {name}, which this model has: its architecture differs "
                             f"beyond the attention ({STRUCTURE_OPTIONS})")
        added.append(name)
        if name.endswith("gate_logit") or name.endswith("gate_proj.bias"):
            state_dict[key] = torch.full_like(value, GATE_LOGIT)
        elif name.endswith("gate_proj.weight"):
            state_dict[key] = torch.zeros_like(value)
        else:
            state_dict[key] = value.clone()
    if dropped:
        logger.info(f"lion: from the softmax checkpoint, dropped what this LION model has no use for: "
                    f"{_summary(dropped)}")
    if added:
        logger.info(f"lion: added what LION has and the checkpoint lacks (gates at sigmoid({GATE_LOGIT:g}), the "
                    f"rest as initialised): {_summary(added)}")


def _summary(names: List[str]) -> str:
    """Names with layer numbers collapsed: ``layers.*.self_attn.gate_proj.weight`` once, not per layer."""
    seen: Dict[str, None] = {}
    for n in names:
        seen.setdefault(re.sub(r"layers\.\d+\.", "layers.*.", n), None)
    return ", ".join(seen)


def teacher_sizes(state: Dict) -> Dict[str, Optional[int]]:
    """The encoder sizes a RoBERTa checkpoint was trained with (legacy ``args`` or dataclass ``cfg``)."""
    source = state.get("args")
    if source is None and state.get("cfg") is not None:
        source = state["cfg"].get("model")
    if source is None:
        source = {}
    elif not hasattr(source, "get"):  # an argparse.Namespace: legacy models' config, also inside cfg
        source = vars(source)
    keys = ("encoder_layers", "encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_attention_heads",
            "max_positions")
    return {k: source.get(k) for k in keys}
