"""Use the trained checkpoints as a user would from Python: fill a ``<mask>`` through the RoBERTa-style
hub interface, and continue a prompt through fairseq's ``SequenceGenerator`` (hub ``sample``), both with
the model switched to the recurrent form. Generation decodes token by token from the LION state
``(S, z)`` per layer and head (``incremental_state``), O(1) per token whatever the context."""
from pathlib import Path
from typing import Dict, List, Tuple

import torch


def _sentencepiece(data: Path) -> Dict[str, str]:
    return {"bpe": "sentencepiece", "sentencepiece_model": str(data / "sentencepiece.bpe.model")}


def fill_mask(checkpoint: Path, data: Path, masked: str, topk: int = 5) -> List[Tuple[str, float, str]]:
    """Top-``topk`` fillers of the one ``<mask>`` in ``masked``: (filled sentence, probability, token)."""
    from lion_fairseq.models.lion_encoder import LionRobertaModel

    hub = LionRobertaModel.from_pretrained(str(checkpoint.parent), checkpoint.name, str(data),
                                           lion_form="recurrent", **_sentencepiece(data))
    hub.eval()
    with torch.no_grad():
        return hub.fill_mask(masked, topk=topk)


def state_floats(checkpoint: Path) -> Tuple[int, int, int]:
    """(layers, heads, floats of decoding state per layer) of a LION LM: ``H * (Dk * Dv + Dk)``."""
    cfg = torch.load(checkpoint, map_location="cpu", weights_only=True)["cfg"]["model"]
    heads, dim, layers = cfg["decoder_attention_heads"], cfg["decoder_embed_dim"], cfg["decoder_layers"]
    d = dim // heads
    return layers, heads, heads * (d * d + d)


def generate(checkpoint: Path, data: Path, prompt: str, seed: int, max_len: int = 40) -> Dict[str, str]:
    """Continuations of ``prompt``: ``sampled`` (top-k 10) and ``beam`` (beam 4, no repeated 3-grams),
    each 12 to ``max_len`` new tokens (a barely trained model would often end the text at once)."""
    from lion_fairseq.models.lion_lm import LionLanguageModel

    hub = LionLanguageModel.from_pretrained(str(checkpoint.parent), checkpoint.name, str(data),
                                            lion_form="recurrent", **_sentencepiece(data))
    hub.eval()
    min_len = 12  # the LION LM's hub counts lengths after the prompt
    torch.manual_seed(seed)
    with torch.no_grad():
        sampled = hub.sample(prompt, beam=1, sampling=True, sampling_topk=10, temperature=0.8, min_len=min_len,
                             max_len_b=max_len)
        beam = hub.sample(prompt, beam=4, min_len=min_len, max_len_b=max_len, no_repeat_ngram_size=3)
    return {"sampled": sampled, "beam": beam}
