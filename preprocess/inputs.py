"""Reading users' text files: existence, emptiness and UTF-8 checked, with file:line in every error."""
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, Tuple, Union

from preprocess.errors import PreprocessError

PathLike = Union[str, Path]


@dataclass
class TextFileInfo:
    """What a first pass over a text file found."""

    path: Path
    lines: int  # all lines, blank ones included (fairseq keeps them: they end documents)
    nonblank: int
    bytes: int


def require_file(path: PathLike, option: str) -> Path:
    """Return ``path`` as a Path if it is an existing regular file, else say which option named it."""
    p = Path(path)
    if not p.exists():
        raise PreprocessError(f"{option}: file not found: {p}")
    if not p.is_file():
        raise PreprocessError(f"{option}: not a regular file: {p}")
    return p


def iter_lines(path: PathLike) -> Iterator[Tuple[int, str]]:
    """Yield ``(line_number, text)`` with the line ending removed, decoding strict UTF-8.

    Lines are split on ``\\n`` only (a CRLF's ``\\r`` is dropped), so numbers match what editors and
    ``sed -n Np`` show; a UTF-8 byte-order mark at the start is dropped. Undecodable bytes raise a
    :class:`PreprocessError` naming the file, line and column.
    """
    p = Path(path)
    with open(p, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if number == 1 and raw.startswith(b"\x1f\x8b"):
                    raise PreprocessError(f"{p}: is gzip-compressed; unpack it first (gunzip -k)") from None
                if number == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
                    raise PreprocessError(f"{p}: is UTF-16; convert it to UTF-8, e.g. `iconv -f utf-16 -t utf-8`") \
                        from None
                bad = raw[e.start:e.end]
                raise PreprocessError(
                    f"{p}:{number}: not valid UTF-8 (byte {bad!r} at column {e.start + 1}); convert the file to "
                    f"UTF-8, e.g. `iconv -f latin1 -t utf-8` for Latin-1") from None
            if number == 1 and text.startswith("\ufeff"):
                text = text[1:]
            if text.endswith("\n"):
                text = text[:-1]
            if text.endswith("\r"):
                text = text[:-1]
            yield number, text


def check_text_file(path: PathLike, option: str) -> TextFileInfo:
    """First pass over an input file: it exists, is UTF-8 throughout, and holds some text."""
    p = require_file(path, option)
    lines = nonblank = 0
    for lines, text in iter_lines(p):
        if text.strip():
            nonblank += 1
    if nonblank == 0:
        what = "empty (0 bytes)" if lines == 0 else f"empty (only {lines} blank lines)"
        raise PreprocessError(f"{option}: file is {what}: {p}")
    return TextFileInfo(p, lines, nonblank, p.stat().st_size)


def check_text_files(paths: Sequence[PathLike], option: str) -> list:
    """:func:`check_text_file` on each path, in order."""
    return [check_text_file(p, option) for p in paths]
