"""fairseq's ``--no-repeat-ngram-size`` (``no_repeat_ngram_size`` in the hubs) where its CUDA extension is not
built (CPUs, and GPUs with a wheel that lacks it): ``NGramRepeatBlock._no_repeat_ngram`` compared the end of
the whole token buffer, padding past the current step, with the earlier n-grams, so it banned nothing and beam
search repeated itself (fairseq #5206). Replaced by the same rule read up to the current step."""
import math

import torch
from fairseq.ngram_repeat_block import NGramRepeatBlock


def _no_repeat_ngram(self, tokens: torch.Tensor, lprobs: torch.Tensor, bsz: int, beam_size: int,
                     step: int) -> torch.Tensor:
    """tokens: ``(bsz * beam_size, max_len + 2)``, filled up to ``step``; lprobs: ``(bsz * beam_size, V)``,
    the next token's, set to -inf in place where that token would repeat an n-gram of its row."""
    n = self.no_repeat_ngram_size
    start = step + 2 - n  # the first position of the n-gram the next token would end
    if start < 0:
        return lprobs
    for row, ids in enumerate(tokens[:, :step + 1].tolist()):
        prefix = ids[start:]
        # from 1: position 0 holds the start symbol, </s>, which no n-gram may ban (with n = 1 no hypothesis
        # could end, and fairseq asserted at the length limit)
        banned = [ids[i + n - 1] for i in range(1, start) if ids[i:i + n - 1] == prefix]
        if banned:
            lprobs[row, banned] = -math.inf
    return lprobs


def install() -> None:
    NGramRepeatBlock._no_repeat_ngram = _no_repeat_ngram
