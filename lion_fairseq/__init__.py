"""lion-fairseq: LION attention for fairseq. Importing the package (``--user-dir lion_fairseq``) registers
its models, tasks and criterions with fairseq; ``lion_fairseq.ops`` is the pure-PyTorch operator.

Without fairseq the import warns what to install and registers nothing, so that the operator still serves
a PyTorch model of one's own; the hub classes then raise that message. A fairseq older than 0.12 is
refused: there the plugin is being used, with a fairseq it does not run on."""
import logging
import warnings
from typing import Optional

__all__ = ["LionLanguageModel", "LionRobertaModel", "LionTransformerModel"]

INSTALL = ("On Python 3.11 install the rebuild without its torchaudio pin:\n"
           "  pip install torch==<your torch> && pip install --no-deps ve-fairseq==0.12.3 && "
           "pip install -r requirements.txt\n(or run `bash run.sh test` in the checkout, which does all of it)")


def _import_fairseq():
    """``import fairseq``, leaving Python's logging as it was. Three of fairseq's modules call
    ``logging.basicConfig`` as they are imported, one at DEBUG: in a Python session (fairseq's commands set
    logging up first) every library's debug lines then printed. basicConfig leaves a root logger that has a
    handler alone, so Python's own fallback (warnings and errors to stderr) stands in as one meanwhile."""
    root = logging.getLogger()
    stand_in = None if root.handlers else (logging.lastResort or logging.NullHandler())
    if stand_in is not None:
        root.addHandler(stand_in)
    try:
        import fairseq
        return fairseq
    finally:
        if stand_in is not None:
            root.removeHandler(stand_in)


def _missing_fairseq() -> Optional[str]:
    """Why fairseq is not there, with what to install; None where it is (raises where it is too old)."""
    try:
        fairseq = _import_fairseq()
    except ImportError as e:
        return f"lion_fairseq's models need fairseq ({e}); its operator, lion_fairseq.ops, does not. {INSTALL}"
    version = tuple(int(x) for x in fairseq.__version__.split(".")[:2] if x.isdigit())
    if version < (0, 12):
        raise ImportError(f"lion_fairseq needs fairseq >= 0.12 (found {fairseq.__version__}); on Python 3.11 "
                          "install ve-fairseq==0.12.3 with --no-deps (see README, Install)")
    return None


FAIRSEQ_PROBLEM = _missing_fairseq()

if FAIRSEQ_PROBLEM is None:
    from . import numpy_compat  # noqa: F401  (fairseq 0.12 reads np.compat.long, gone in numpy 2)
    from . import clean_exit  # (fairseq's prefetching thread aborts an exit that finds it mid-batch)
    clean_exit.install()
    from . import ngram_blocking  # (fairseq's --no-repeat-ngram-size banned nothing without its CUDA extension)
    ngram_blocking.install()
    from . import models  # noqa: F401  (registers the models with fairseq)
    from . import tasks  # noqa: F401
    from . import criterions  # noqa: F401
    from . import clear_errors  # (clear messages for broken checkpoints, data, DDP backends)
    clear_errors.install()

    # the hub classes, as ``from lion_fairseq import LionRobertaModel``
    from .models.lion_encoder import LionRobertaModel
    from .models.lion_lm import LionLanguageModel
    from .models.lion_transformer import LionTransformerModel
else:
    warnings.warn(FAIRSEQ_PROBLEM, stacklevel=2)

    def __getattr__(name: str):
        if name in __all__:
            raise ImportError(FAIRSEQ_PROBLEM)
        raise AttributeError(f"module 'lion_fairseq' has no attribute {name!r}")
