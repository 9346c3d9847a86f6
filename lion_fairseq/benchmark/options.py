"""Command-line value types the benchmarks share."""
import argparse
from pathlib import Path
from typing import Any, Tuple


def positive_int(text: str) -> int:
    """An integer >= 1 (a length, a thread count, a number of repeats or updates), else argparse's usage
    error naming the option."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {value}")
    return value


def out_folder(text: str) -> Path:
    """``--out``: a folder, made if missing; a file of that name is argparse's usage error naming the option
    (a FileExistsError traceback from mkdir, at the end of the set-up)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file: pass a folder for the results")
    return path


def default_text(defaults: Tuple[Any, Any]) -> str:
    """``(default 64 256; --small: 64)``: the help's account of a ``(full, small)`` pair that ``fill_unset``
    fills in, from the pair itself."""
    def shown(value: Any) -> str:
        return " ".join(map(str, value)) or "none" if isinstance(value, (list, tuple)) else str(value)

    return f"(default {shown(defaults[0])}; --small: {shown(defaults[1])})"


def fill_unset(args: argparse.Namespace, small: bool, **defaults: Tuple[Any, Any]) -> None:
    """Set each option named in ``defaults`` that the command line left None to its default: the first of
    its pair, or with ``--small`` the second (a list copied: the table's stays as it is). An option given keeps
    its value, ``--small`` or not."""
    for key, (full, short) in defaults.items():
        if getattr(args, key) is None:
            value = short if small else full
            setattr(args, key, list(value) if isinstance(value, list) else value)
