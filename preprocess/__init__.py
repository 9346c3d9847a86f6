"""Raw text -> sentencepiece -> fairseq binarised data, for LION models.

Three commands, each a module you run with ``python -m``:

- ``python -m preprocess.text``: text files -> a sentencepiece model, ``dict.txt`` whose ids equal the
  sentencepiece ids, and ``train``/``valid``/``test`` binaries for ``masked_lm`` and
  ``language_modeling``.
- ``python -m preprocess.glue``: GLUE-style TSV files -> the ``input0/``, ``input1/``, ``label/``
  layout that fairseq's ``sentence_prediction`` task reads, encoded with the LM's model and dict.
- ``python -m preprocess.lra``: the Long Range Arena releases -> the same layout (bytes, pixels or ListOps
  tokens, no sentencepiece) with an ``lra.json`` that lion_fairseq's ``lra_*`` tasks read.

All three write into a hidden staging folder beside ``--destdir`` and rename it into place only when
everything succeeded, and turn bad input into one clear line and a non-zero exit.
See ``preprocess/README.md``.
"""
from preprocess.errors import PreprocessError

__all__ = ["PreprocessError"]
