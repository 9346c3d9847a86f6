"""The demo's text: Python's own help topics (``pydoc_data.topics``, shipped with every Python) as plain
English, one paragraph per line, or the user's files; and prompts for the mask filler and the LM."""
import re
from pathlib import Path
from typing import List, Sequence, Tuple

# a line made only of these is a heading's underline ("*****", "=====") in pydoc's reST-like text
_UNDERLINE = re.compile(r"\s*[*=\-~^#]+\s*")

# prompts for the default corpus: sentences of its training part (the mask hides "objects"), so that a
# few minutes of training show something
PYDOC_MASK_PROMPT = "The following methods can be defined to emulate numeric <mask>."
PYDOC_LM_PROMPT = "The return value"


def pydoc_paragraphs() -> List[str]:
    """The help topics as lines of text: a prose paragraph per line (its wrapped lines joined), code
    blocks (indented) a line per source line, and a blank line between topics (a document break)."""
    from pydoc_data.topics import topics

    lines: List[str] = []
    for key in sorted(topics):  # sorted: the same corpus, hence the same splits, on every run
        for block in re.split(r"\n\s*\n", topics[key]):
            raw = [line for line in block.splitlines() if line.strip() and not _UNDERLINE.fullmatch(line)]
            if not raw:
                continue
            if raw[0].startswith("   "):  # an indented block is code or a grammar rule: keep its lines
                lines.extend(line.strip() for line in raw)
            else:
                lines.append(" ".join(line.strip() for line in raw))
        lines.append("")
    return lines


def write_pydoc_corpus(path: Path) -> Path:
    """Write :func:`pydoc_paragraphs` to ``path`` (UTF-8) and return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(pydoc_paragraphs()) + "\n"
    # rewrite only on change, so the file's time stamp means something to a user looking at the workdir
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return path


def check_corpus_files(files: Sequence[str]) -> List[Path]:
    """The ``--corpus`` files as paths; ``ValueError`` naming the option for a missing or empty one
    (``preprocess.text`` checks encodings and sizes in detail)."""
    paths = []
    for name in files:
        p = Path(name)
        if p.is_dir():
            raise ValueError(f"--corpus: {name} is a folder: pass its text files ({name}/*.txt, say)")
        if not p.is_file():
            raise ValueError(f"--corpus: no such file: {name}")
        if p.stat().st_size == 0:
            raise ValueError(f"--corpus: empty file: {name}")
        paths.append(p.resolve())
    return paths


def prompts_from_text(files: Sequence[Path]) -> Tuple[str, str]:
    """(mask prompt, LM prompt) for a user's corpus: from its last lines (the held-out part), the first
    with 8 or more words gets its middle word masked, and the next such line gives its first 4 words."""
    words_of_lines: List[List[str]] = []
    for f in reversed(list(files)):
        with open(f, encoding="utf-8", errors="replace") as fh:
            tail = fh.readlines()[-400:]
        for line in reversed(tail):
            words = line.split()
            if len(words) >= 8:
                words_of_lines.append(words[:40])
            if len(words_of_lines) == 2:
                break
        if len(words_of_lines) == 2:
            break
    if not words_of_lines:
        return "<mask>", ""
    words = list(words_of_lines[0])
    words[len(words) // 2] = "<mask>"
    lm_words = words_of_lines[-1][:4]
    return " ".join(words), " ".join(lm_words)
