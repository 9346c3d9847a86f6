"""lion-fairseq: LION attention for fairseq. Importing the package (``--user-dir lion_fairseq``) registers
its models, tasks and criterions with fairseq; ``lion_fairseq.ops`` is the pure-PyTorch operator."""
try:
    import fairseq  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lion_fairseq needs fairseq. On Python 3.11 install the rebuild without its torchaudio pin:\n"
        "  pip install torch==<your torch> && pip install --no-deps ve-fairseq==0.12.3 && "
        "pip install -r requirements.txt\n(or run `bash run.sh test` in the checkout, which does all of it)"
    ) from e
if tuple(int(x) for x in fairseq.__version__.split(".")[:2] if x.isdigit()) < (0, 12):
    raise ImportError(f"lion_fairseq needs fairseq >= 0.12 (found {fairseq.__version__}); on Python 3.11 "
                      "install ve-fairseq==0.12.3 with --no-deps (see README, Install)")

from . import numpy_compat  # noqa: E402,F401  (fairseq 0.12 reads np.compat.long, gone in numpy 2)
from . import models  # noqa: E402,F401  (registers the models with fairseq)
from . import tasks  # noqa: E402,F401
from . import criterions  # noqa: E402,F401
from . import clear_errors  # noqa: E402  (clear messages for broken checkpoints, data, DDP backends)
clear_errors.install()

# the hub classes, as ``from lion_fairseq import LionRobertaModel``
from .models.lion_encoder import LionRobertaModel  # noqa: E402
from .models.lion_lm import LionLanguageModel  # noqa: E402
from .models.lion_transformer import LionTransformerModel  # noqa: E402

__all__ = ["LionLanguageModel", "LionRobertaModel", "LionTransformerModel"]
