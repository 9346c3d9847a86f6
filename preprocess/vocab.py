"""Sentencepiece models whose ids are fairseq's ids: training, the matching dict.txt, and encoding.

fairseq's ``Dictionary`` puts ``<s> <pad> </s> <unk>`` at ids 0-3 and then the words of ``dict.txt``
in file order. We train sentencepiece with the same four specials at the same ids and write every
other piece to ``dict.txt`` in id order, so a token id means the same thing in both.
"""
import logging
import re
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import sentencepiece as spm

from preprocess.errors import PreprocessError
from preprocess.progress import Progress, call_with_heartbeat

log = logging.getLogger("preprocess")

#: fairseq Dictionary's special symbols, in id order.
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
SPECIAL_IDS = {"bos_id": 0, "pad_id": 1, "eos_id": 2, "unk_id": 3}
#: spm options this module fixes, because changing them would break the id alignment.
FIXED_OPTIONS = set(SPECIAL_IDS) | {"bos_piece", "pad_piece", "eos_piece", "unk_piece", "model_prefix",
                                    "input", "vocab_size", "model_type", "character_coverage"}
# sentencepiece trains on lines up to this many bytes and leaves longer ones out (its own default, 4192, would
# leave out many of the paragraphs a line may hold); they are still encoded
MAX_LINE_BYTES = 65536
MODEL_NAME = "sentencepiece.bpe.model"  # the name fairseq's hub_utils.from_pretrained looks for


def parse_spm_options(items: Sequence[str]) -> Dict[str, str]:
    """``["key=value", ...]`` from ``--spm-option`` into trainer keyword arguments."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise PreprocessError(f"--spm-option: expected KEY=VALUE, got {item!r}")
        if key in FIXED_OPTIONS:
            raise PreprocessError(f"--spm-option: {key} is set by this tool (it keeps sentencepiece and "
                                  f"fairseq ids equal, or has its own option); remove it")
        out[key] = value
    return out


def train_spm(train_file: Path, model_prefix: Path, vocab_size: int, model_type: str,
              character_coverage: float, corpus: str = "", threads: int = 1,
              input_sentence_size: int = 10_000_000,
              extra: Optional[Dict[str, str]] = None, verbose: bool = False,
              heartbeat_s: float = 30.0) -> Path:
    """Train a sentencepiece model on ``train_file`` with fairseq's special ids; return the .model path.

    Sentencepiece's own refusals (vocabulary too large or too small for the corpus) become a
    :class:`PreprocessError` that says which ``--vocab-size`` would work.
    """
    log.info("training sentencepiece (%s, vocab %d, character coverage %g) on %s%s", model_type,
             vocab_size, character_coverage, train_file,
             "" if verbose else "; --verbose shows its progress")
    start = time.time()
    kwargs = dict(input=str(train_file), model_prefix=str(model_prefix), vocab_size=vocab_size,
                  model_type=model_type, character_coverage=character_coverage,
                  num_threads=max(1, threads), input_sentence_size=input_sentence_size,
                  max_sentence_length=MAX_LINE_BYTES, shuffle_input_sentence=True,
                  minloglevel=0 if verbose else 1, **SPECIAL_IDS)
    kwargs.update(extra or {})
    try:
        call_with_heartbeat(lambda: spm.SentencePieceTrainer.train(**kwargs), "sentencepiece training",
                            heartbeat_s)
    except (RuntimeError, OSError, ValueError) as e:  # ValueError: an --spm-option value it cannot parse
        raise PreprocessError(_explain_spm_failure(str(e), vocab_size, model_type, character_coverage,
                                                   corpus or str(train_file))) from None
    if model_type == "char":
        # sentencepiece fits a char model into any --vocab-size, leaving the characters past it unknown
        # (the other types refuse that size): a model with every piece used may have left some out
        kept = spm.SentencePieceProcessor(model_file=f"{model_prefix}.model").get_piece_size()
        if kept >= vocab_size:
            counting = Path(f"{model_prefix}.chars")
            spm.SentencePieceTrainer.train(**dict(kwargs, model_prefix=str(counting), vocab_size=1 << 20,
                                                  minloglevel=1))
            need = spm.SentencePieceProcessor(model_file=f"{counting}.model").get_piece_size()
            for suffix in (".model", ".vocab"):
                Path(f"{counting}{suffix}").unlink()
            if need > vocab_size:
                raise PreprocessError(_too_small(vocab_size, need, character_coverage, corpus or str(train_file)))
    log.info("trained sentencepiece in %.1fs", time.time() - start)
    return Path(f"{model_prefix}.model")


def _too_small(vocab_size: int, need: int, coverage: float, corpus: str) -> str:
    return (f"--vocab-size {vocab_size} is too small for {corpus}: its characters alone need "
            f"{need} pieces at --character-coverage {coverage}. Pass --vocab-size {need} or more, "
            f"or lower --character-coverage.")


def _explain_spm_failure(msg: str, vocab_size: int, model_type: str, coverage: float, corpus: str) -> str:
    too_high = re.search(r"Vocabulary size too high \((\d+)\).*?<= (\d+)", msg)
    if too_high:
        most = int(too_high.group(2))
        return (f"--vocab-size {vocab_size} is too large for this corpus: at most {most} pieces fit "
                f"(--model-type {model_type}, {corpus}). "
                f"Pass --vocab-size {most} or smaller, or give more text "
                f"(or --spm-option hard_vocab_limit=false to accept fewer pieces).")
    too_low = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
    if too_low:
        return _too_small(vocab_size, int(too_low.group(2)), coverage, corpus)  # specials counted in already
    if "sentences_.empty()" in msg:
        return (f"sentencepiece found no line to train on in {corpus}: it leaves out lines longer than "
                f"max_sentence_length bytes ({MAX_LINE_BYTES} unless set); pass --spm-option "
                f"max_sentence_length=N with N above the longest line's bytes, or split the lines")
    return f"sentencepiece training failed: {msg}"


def load_spm(model_file: Path, option: str = "--spm-model") -> spm.SentencePieceProcessor:
    """Load a model and check that its special ids are fairseq's (else ids would not line up)."""
    try:
        sp = spm.SentencePieceProcessor(model_file=str(model_file))
    except (RuntimeError, OSError) as e:
        raise PreprocessError(f"{option}: not a sentencepiece model: {model_file} ({e})") from None
    got = {"bos_id": sp.bos_id(), "pad_id": sp.pad_id(), "eos_id": sp.eos_id(), "unk_id": sp.unk_id()}
    if got != SPECIAL_IDS or [sp.id_to_piece(i) for i in range(4)] != list(FAIRSEQ_SPECIALS):
        raise PreprocessError(
            f"{option}: {model_file} has special ids {got}, but fairseq's dictionary needs {SPECIAL_IDS} "
            f"with pieces {' '.join(FAIRSEQ_SPECIALS)}; train the model with preprocess.text")
    for i in range(len(FAIRSEQ_SPECIALS), sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        # fairseq splits encoded lines on whitespace, so a piece must be one whitespace-free word.
        if piece.split() != [piece]:
            raise PreprocessError(f"{option}: piece {i} ({piece!r}) contains whitespace, which fairseq "
                                  f"cannot read back; retrain without that normalisation")
    return sp


def dict_words(sp: spm.SentencePieceProcessor) -> List[str]:
    """The words of ``dict.txt`` for this model: every piece after the four specials, in id order."""
    return [sp.id_to_piece(i) for i in range(len(FAIRSEQ_SPECIALS), sp.get_piece_size())]


def write_dict(sp: spm.SentencePieceProcessor, path: Path, counts: Optional[np.ndarray] = None) -> None:
    """Write fairseq's ``dict.txt`` for ``sp``; counts (piece frequencies in train) are informative only."""
    with open(path, "w", encoding="utf-8") as f:
        for i, word in enumerate(dict_words(sp), len(FAIRSEQ_SPECIALS)):
            f.write(f"{word} {int(counts[i]) if counts is not None else 1}\n")


def check_dict_matches(sp: spm.SentencePieceProcessor, dict_file: Path, option: str = "--dict") -> None:
    """Fail unless ``dict_file`` lists exactly the model's pieces in id order (the LM's dict.txt)."""
    words = []
    with open(dict_file, encoding="utf-8", errors="replace") as f:
        for line in f:
            word = line.rstrip("\n").rsplit(" ", 1)[0]
            if word.endswith(" #fairseq:overwrite"):
                word = word[: -len(" #fairseq:overwrite")]
            words.append(word)
    expected = dict_words(sp)
    for i, (want, got) in enumerate(zip(expected, words)):
        if want != got:
            raise PreprocessError(
                f"{option}: {dict_file} does not match the sentencepiece model: line {i + 1} is {got!r}, "
                f"the model's piece {i + len(FAIRSEQ_SPECIALS)} is {want!r}; pass the dict.txt that "
                f"preprocess.text wrote next to this model")
    if len(words) < len(expected):
        raise PreprocessError(f"{option}: {dict_file} has {len(words)} words, the sentencepiece model "
                              f"{len(expected)}; pass the dict.txt written with this model")


def encode_file(sp: spm.SentencePieceProcessor, src: Path, dst: Path, n_lines: int, desc: str,
                threads: int = 1, counts: Optional[np.ndarray] = None, batch: int = 20_000) -> Dict[str, int]:
    """Encode ``src`` line by line into space-separated pieces in ``dst`` (same line count).

    Goes through ids rather than piece strings so an unknown character is written as ``<unk>``
    (sentencepiece would otherwise return its raw surface, which fairseq might split). Adds piece
    frequencies into ``counts`` if given. Returns line, token and unknown counts.
    """
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    unk = sp.unk_id()
    stats = {"lines": 0, "tokens": 0, "unk": 0}

    def flush(lines: List[str], out) -> None:
        ids = sp.encode(lines, out_type=int, num_threads=max(1, threads))
        out.write("".join(" ".join([pieces[t] for t in seq]) + "\n" for seq in ids))
        flat = np.fromiter((t for seq in ids for t in seq), dtype=np.int64)
        if counts is not None and flat.size:
            np.add(counts, np.bincount(flat, minlength=len(counts)), out=counts)
        stats["lines"] += len(lines)
        stats["tokens"] += int(flat.size)
        stats["unk"] += int((flat == unk).sum())

    with open(src, encoding="utf-8", newline="\n") as fin, open(dst, "w", encoding="utf-8") as out, \
            Progress(n_lines, desc) as bar:
        buf: List[str] = []
        for line in fin:
            buf.append(line.rstrip("\n"))
            if len(buf) >= batch:
                flush(buf, out)
                bar.update(len(buf))
                buf = []
        if buf:
            flush(buf, out)
            bar.update(len(buf))
    log.info("%s: %d lines, %d tokens, %d unknown (%.3f%%)", desc, stats["lines"], stats["tokens"],
             stats["unk"], 100.0 * stats["unk"] / max(1, stats["tokens"]))
    return stats
