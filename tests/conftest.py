"""Shared fixtures: a small real English corpus (pydoc_data.topics, shipped with every Python),
binarised by fairseq-preprocess once per test session."""
import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import pytest
import torch

import warm_python

# Without a GPU, flash-linear-attention's Triton kernels run under Triton's CPU interpreter
# (tests/triton_interpreter.py). Triton reads this when a kernel is defined, i.e. when fla is imported:
# before any test module can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# hypothesis keeps its caches in .hypothesis/ under the folder pytest runs in, the checkout: kept out of it
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(
    tempfile.gettempdir(), f"lion-fairseq-hypothesis-{os.getuid() if hasattr(os, 'getuid') else 0}"))

# Under pytest-xdist each worker gets its share of the cores, in process and in the fairseq commands it
# starts. Two workers each starting 2-thread OpenMP on 2 cores made a tiny training 16x slower (each
# small op waits for a thread the other process holds). Workers inherit the controller's environment,
# so this is set, not defaulted.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# fairseq's commands, wherever the tests start them, fork from a process that has imported torch and fairseq
# (each spent 5-6 s importing them, and the suite starts about 160); LION_TEST_COLD=1 starts each afresh
warm_python.install()

# `bash run.sh test` hands test files to its two workers in this order (xdist's --dist loadfile with
# --no-loadscope-reorder): the longest first, so that no long file starts last while the other worker idles.
# The nine that take longest, by their tests' seconds in a whole run on a CI-like machine (127 down to 54; the
# others under 45).
LONGEST_FIRST = ("test_kernel.py", "test_reliability.py", "test_mixed_precision.py", "test_convert.py",
                 "test_recipes.py", "test_fla.py", "test_lm.py", "test_encoder.py", "test_translation.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their own order


ROOT = Path(__file__).resolve().parents[1]
USER_DIR = str(ROOT / "lion_fairseq")


def corpus_lines(n_lines: int = 6000, max_words: int = 60):
    """Lower-cased, word-tokenised lines of pydoc's topic help, deterministic."""
    from pydoc_data.topics import topics

    lines = []
    for key in sorted(topics):
        for raw in topics[key].splitlines():
            words = re.findall(r"[a-z]+|[0-9]+|[^\sa-z0-9]", raw.lower())
            if len(words) >= 4:
                lines.append(" ".join(words[:max_words]))
    return lines[:n_lines]


def fairseq_cli(module: str, *args: str, cwd=None, timeout=900, stdin=None) -> subprocess.CompletedProcess:
    """Run ``python -m fairseq_cli.<module>`` like a user's console command; fail loudly with its output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run([sys.executable, "-m", f"fairseq_cli.{module}", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, input=stdin)
    if proc.returncode != 0:
        raise AssertionError(f"fairseq_cli.{module} {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def preprocess(*args: str) -> None:
    """fairseq-preprocess in this process, for a fixture's data (the command itself runs as users type it in
    test_recipes.py's recipes): no second Python to start and import fairseq."""
    from preprocess.binarize import run_fairseq_preprocess

    run_fairseq_preprocess(list(args))


@pytest.fixture(scope="session")
def labelled_data_bin(text_data_bin, tmp_path_factory) -> Path:
    """``labelled_data`` of the corpus's dictionary (read only: the tests share it)."""
    return labelled_data(tmp_path_factory.mktemp("labelled"), text_data_bin / "dict.txt")


def labelled_data(root: Path, dict_txt: Path) -> Path:
    """A balanced, learnable labelling of real lines: 1 if the line starts with a word, 0 if it starts
    with a symbol; binarised in sentence_prediction's layout (input0/, label/) in ``root / "bin"``, its text
    in ``root``."""
    rng = random.Random(0)
    lines = corpus_lines()
    words = [s for s in lines if s.split()[0].isalpha()]
    symbols = [s for s in lines if not s.split()[0].isalpha()]
    n = min(len(words), len(symbols))
    data = [(s, 1) for s in rng.sample(words, n)] + [(s, 0) for s in rng.sample(symbols, n)]
    rng.shuffle(data)
    split = {"train": data[: int(0.85 * len(data))], "valid": data[int(0.85 * len(data)):]}
    for name, rows in split.items():
        (root / f"{name}.input0").write_text("".join(s + "\n" for s, _ in rows))
        (root / f"{name}.label").write_text("".join(f"{y}\n" for _, y in rows))
    out = root / "bin"
    preprocess("--only-source", "--trainpref", str(root / "train.input0"), "--validpref", str(root / "valid.input0"),
               "--destdir", str(out / "input0"), "--srcdict", str(dict_txt), "--workers", "1")
    preprocess("--only-source", "--trainpref", str(root / "train.label"), "--validpref", str(root / "valid.label"),
               "--destdir", str(out / "label"), "--workers", "1")
    return out


def training_args(data: Path, task: str, *args: str, parser: Optional[argparse.ArgumentParser] = None
                  ) -> argparse.Namespace:
    """fairseq-train's parsed command line for ``data`` and ``args``, with this plugin's ``--user-dir``.
    ``parser``: fairseq's training parser to parse with (it gains the task's and the model's options)."""
    from fairseq import options

    parser = parser or options.get_training_parser()
    return options.parse_args_and_arch(parser, [str(data), "--user-dir", USER_DIR, "--task", task, *args])


def build_model(data: Path, task: str, *args: str):
    """(task, model) as fairseq-train builds them from ``data`` and command-line ``args``, in train mode."""
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(training_args(data, task, *args))
    t = tasks.setup_task(cfg.task)
    return t, t.build_model(cfg.model)


@pytest.fixture
def one_thread():
    """In-process torch work on one thread, restored afterwards for other test files."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def text_data_bin(tmp_path_factory) -> Path:
    """A binarised word-level corpus (train/valid/test) in fairseq's layout, with dict.txt."""
    root = tmp_path_factory.mktemp("corpus")
    lines = corpus_lines()
    n = len(lines)
    splits = {"train": lines[: int(n * 0.9)], "valid": lines[int(n * 0.9): int(n * 0.95)],
              "test": lines[int(n * 0.95):]}
    for name, part in splits.items():
        (root / f"{name}.txt").write_text("\n".join(part) + "\n")
    out = root / "bin"
    preprocess("--only-source", "--trainpref", str(root / "train.txt"), "--validpref", str(root / "valid.txt"),
               "--testpref", str(root / "test.txt"), "--destdir", str(out), "--nwordssrc", "2000", "--workers", "1")
    return out
