"""fairseq's own binariser (``fairseq_cli.preprocess``) on already-encoded text, with a fixed dict."""
import argparse
import logging
import time
from pathlib import Path
from typing import Dict, List

from preprocess.errors import PreprocessError
from preprocess.progress import call_with_heartbeat

log = logging.getLogger("preprocess")

SPLIT_OPTIONS = {"train": "--trainpref", "valid": "--validpref", "test": "--testpref"}


def binarize(dict_file: Path, splits: Dict[str, Path], destdir: Path, workers: int = 1) -> None:
    """Write ``destdir/{split}.bin/.idx`` and ``destdir/dict.txt`` for each ``split -> text file``.

    Runs ``fairseq_cli.preprocess.main`` in this process (one fairseq import for all calls) with
    ``--only-source --srcdict dict_file``, so no dictionary is rebuilt and ids stay as given;
    ``--workers`` splits each file across processes.
    """
    unknown = set(splits) - set(SPLIT_OPTIONS)
    if unknown:
        raise ValueError(f"unknown split names {sorted(unknown)}; expected {sorted(SPLIT_OPTIONS)}")
    for path in [dict_file, destdir, *splits.values()]:
        if "," in str(path):  # fairseq reads "a,b" as two files
            raise PreprocessError(f"fairseq's preprocess splits paths on ',': {path}")
    from fairseq_cli import preprocess as fairseq_preprocess

    workers = max(1, workers)
    argv = ["--only-source", "--srcdict", str(dict_file), "--destdir", str(destdir),
            "--workers", str(workers), "--dataset-impl", "mmap"]
    for split, path in splits.items():
        argv += [SPLIT_OPTIONS[split], str(path)]
    logger = fairseq_preprocess.logger
    # main() logs its whole argparse Namespace (60 options); our preprocess.json records the command.
    quiet = lambda record: not isinstance(record.msg, argparse.Namespace)  # noqa: E731
    logger.addFilter(quiet)
    log.info("binarising %s into %s with fairseq (%d worker%s)", ", ".join(splits), destdir,
             workers, "s" if workers > 1 else "")
    start = time.time()
    try:
        call_with_heartbeat(lambda: run_fairseq_preprocess(argv), "fairseq binarising")
    except (AssertionError, OSError, RuntimeError, ValueError) as e:
        raise PreprocessError(f"fairseq preprocess failed on {destdir}: {type(e).__name__}: {e}") from e
    finally:
        logger.removeFilter(quiet)
    log.info("binarised in %.1fs", time.time() - start)


def run_fairseq_preprocess(argv: List[str]) -> None:
    """``fairseq-preprocess argv`` in this process (one fairseq import for all calls)."""
    from fairseq import options
    from fairseq_cli import preprocess as fairseq_preprocess

    args = options.get_preprocessing_parser().parse_args(argv)
    logger = fairseq_preprocess.logger
    before = list(logger.handlers)
    try:
        fairseq_preprocess.main(args)
    finally:
        # main() adds a FileHandler on destdir/preprocess.log each call; drop it so later calls
        # (and the rename of a staging folder) do not keep writing to an old file.
        for handler in list(logger.handlers):
            if handler not in before:
                logger.removeHandler(handler)
                handler.close()
