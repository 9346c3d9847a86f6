"""Restore ``numpy.compat.long`` where numpy 2 removed it: fairseq 0.12 still reads it in
``TokenBlockDataset`` (``--sample-break-mode eos``, ``fairseq-interactive`` and the hub's ``sample()``
for language models) and in ``LanguagePairDataset``. numpy 1 defined it as Python's ``int``."""
import types

import numpy as np


def restore_np_compat() -> None:
    """Give numpy a ``compat`` namespace with ``long = int`` unless it already has one; idempotent."""
    try:
        compat = np.compat
    except AttributeError:
        compat = types.ModuleType("numpy.compat", "fairseq-on-numpy-2 shim added by lion_fairseq")
        np.compat = compat
    if not hasattr(compat, "long"):
        compat.long = int


restore_np_compat()
