"""The hub's tokenisation from the data: fairseq's ``from_pretrained`` runs a BPE only when one is passed
(``bpe=``) or the checkpoint names one (``--bpe``); otherwise it splits on whitespace, silently, and
sentencepiece-encoded data then reads as mostly ``<unk>``. ``preprocess.text`` writes its sentencepiece
model into the data folder as ``sentencepiece.bpe.model`` (fairseq's released tarballs keep it beside the
checkpoint): the hubs of the LION models use it when nothing else was asked for, and say so when there is
none."""
import argparse
import logging
import os
import warnings
from typing import Iterable, Optional

logger = logging.getLogger(__name__)

SPM = "sentencepiece.bpe.model"


def data_sentencepiece(folders: Iterable[Optional[str]]) -> Optional[str]:
    """The first ``sentencepiece.bpe.model`` in ``folders`` (the data's, the checkpoint's), or None."""
    for folder in folders:
        if folder and os.path.isfile(os.path.join(folder, SPM)):
            return os.path.join(folder, SPM)
    return None


def sentencepiece_bpe(path: str):
    from fairseq.data import encoders

    return encoders.build_bpe(argparse.Namespace(bpe="sentencepiece", sentencepiece_model=path))


def bpe_from_data(hub, folders: Iterable[Optional[str]]) -> None:
    """Give ``hub`` (a fairseq hub interface whose ``bpe`` is None) the data's sentencepiece model, or warn
    that its inputs are split on whitespace."""
    if hub.bpe is not None:
        return
    path = data_sentencepiece(folders)
    if path is not None:
        hub.bpe = sentencepiece_bpe(path)
        logger.info(f"hub: encoding with the data's sentencepiece model {path}")
        return
    warnings.warn(f"hub: no BPE was passed or named by the checkpoint, and there is no {SPM} in "
                  f"{' or '.join(f for f in folders if f)}: inputs are split on whitespace into dictionary "
                  "entries (right for word-level data; for BPE data pass bpe=..., e.g. bpe='sentencepiece', "
                  "sentencepiece_model=...)", stacklevel=3)


class DataBpeHub:
    """Mixin for fairseq models whose ``from_pretrained`` gives fairseq's ``GeneratorHubInterface``
    (``sample``/``generate``, ``translate``): with no BPE passed or named by the checkpoint, the data's
    ``sentencepiece.bpe.model`` encodes the inputs (``bpe_from_data``)."""

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, checkpoint_file: str = "model.pt",
                        data_name_or_path: str = ".", **kwargs):
        hub = super().from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path, **kwargs)
        bpe_from_data(hub, [getattr(hub.cfg.task, "data", None), model_name_or_path])
        return hub
