"""The folder to pass as ``--user-dir``, for the fairseq commands the package starts itself (benchmarks).
Users get it from the ``lion-fairseq-user-dir`` command (``lion_fairseq_user_dir.py``, outside the package,
so that it does not import fairseq)."""
import os


def path() -> str:
    return os.path.dirname(os.path.abspath(__file__))
