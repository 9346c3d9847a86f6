"""``python -m preprocess.text``: raw text files -> sentencepiece -> fairseq binaries for MLM / LM.

Output in ``--destdir``: ``train``, ``valid``, ``test`` (``.bin``/``.idx``, one item per input line,
blank lines kept as document breaks), ``dict.txt`` (fairseq id == sentencepiece id),
``sentencepiece.bpe.model``/``.vocab``, ``preprocess.json`` (what was done) and fairseq's
``preprocess.log``. Valid and test come from ``--valid``/``--test`` files or, by default, from the
end of the input (contiguous spans; a cut falls between lines, so a document may straddle it).
"""
import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from preprocess.binarize import binarize
from preprocess.errors import PreprocessError, run_main
from preprocess.inputs import TextFileInfo, check_text_files, iter_lines, require_file
from preprocess.staging import check_destdir, staged_destdir
from preprocess import vocab

log = logging.getLogger("preprocess")
SPLITS = ("train", "valid", "test")


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (also used by the README's usage)."""
    p = argparse.ArgumentParser(
        prog="python -m preprocess.text",
        description="Raw UTF-8 text files -> sentencepiece model -> fairseq binarised "
                    "train/valid/test with a dict.txt whose ids are the sentencepiece ids.")
    p.add_argument("--input", "--train", "--trainpref", dest="input", nargs="+", action="extend",
                   required=True, metavar="FILE",
                   help="training text, one sentence/paragraph per line; blank lines separate documents. "
                        "Several files (after one option, or the option repeated) are concatenated.")
    p.add_argument("--destdir", required=True, type=Path, help="output folder (created)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --destdir")
    g = p.add_argument_group("splits (each split: a file or a ratio of the input's last lines)")
    v = g.add_mutually_exclusive_group()
    v.add_argument("--valid", "--validpref", dest="valid", nargs="+", action="extend", metavar="FILE",
                   help="validation text files")
    v.add_argument("--valid-ratio", type=float, default=0.05,
                   help="fraction of input lines held out for valid (default 0.05; 0 = none)")
    t = g.add_mutually_exclusive_group()
    t.add_argument("--test", "--testpref", dest="test", nargs="+", action="extend", metavar="FILE",
                   help="test text files")
    t.add_argument("--test-ratio", type=float, default=0.05,
                   help="fraction of input lines (the very last) held out for test (default 0.05; 0 = none)")
    s = p.add_argument_group("sentencepiece")
    s.add_argument("--vocab-size", type=int, default=8000, help="pieces, specials included (default 8000)")
    s.add_argument("--model-type", choices=["unigram", "bpe", "char", "word"], default="unigram")
    s.add_argument("--character-coverage", type=float, default=1.0,
                   help="share of characters covered by the vocabulary (default 1.0; ~0.9995 for CJK)")
    s.add_argument("--spm-model", type=Path, metavar="FILE",
                   help="reuse this model (one written by this tool) instead of training one")
    s.add_argument("--spm-input-sentence-size", type=int, default=10_000_000,
                   help="train sentencepiece on at most this many sampled lines (default 1e7)")
    s.add_argument("--spm-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra SentencePieceTrainer option, e.g. byte_fallback=true (repeatable)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes/threads for sentencepiece and fairseq's binariser (default 1)")
    p.add_argument("--verbose", action="store_true", help="show sentencepiece's training log")
    return p


# U+0085 (NEL: what cp1252's ellipsis becomes in text decoded as Latin-1) is the one character sentencepiece's
# default normalisation keeps that fairseq splits lines on, so a piece holding it could not be read back
NEL = "\x85"


def _held_out(total: int, ratio: float) -> int:
    return 0 if ratio <= 0 else max(1, round(total * ratio))


def _check_options(args: argparse.Namespace) -> None:
    for name in ("valid_ratio", "test_ratio"):
        r = getattr(args, name)
        if not 0.0 <= r < 1.0:
            raise PreprocessError(f"--{name.replace('_', '-')} must be in [0, 1), got {r}")
    if args.valid is None and args.test is None and args.valid_ratio + args.test_ratio >= 1.0:
        raise PreprocessError("--valid-ratio + --test-ratio must be below 1 (train needs lines too)")
    if args.vocab_size <= len(vocab.FAIRSEQ_SPECIALS):
        raise PreprocessError(f"--vocab-size must exceed the {len(vocab.FAIRSEQ_SPECIALS)} special pieces")
    if not 0.0 < args.character_coverage <= 1.0:
        raise PreprocessError(f"--character-coverage must be in (0, 1], got {args.character_coverage}")
    if args.workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {args.workers}")
    trained = {os.path.realpath(name): name for name in args.input or ()}
    for split in ("valid", "test"):  # a split inside the training text scores what the model learned by heart
        for name in getattr(args, split) or ():
            same = trained.get(os.path.realpath(name))
            if same is not None:
                raise PreprocessError(f"--{split} {name} is also an --input file ({same}): "
                                      f"the {split} split would be text the model trains on; pass another file, or "
                                      f"leave --{split} out to hold out lines of --input")


def _write_splits(inputs: List[TextFileInfo], explicit: Dict[str, Optional[List[TextFileInfo]]],
                  args: argparse.Namespace, work: Path) -> Dict[str, Dict]:
    """Route input lines into ``work/{split}.raw``; return per-split line counts and origin."""
    total = sum(i.lines for i in inputs)
    held = {"valid": 0 if explicit["valid"] else _held_out(total, args.valid_ratio),
            "test": 0 if explicit["test"] else _held_out(total, args.test_ratio)}
    n_train = total - held["valid"] - held["test"]
    if n_train < 1:
        kept = " and ".join(f"{n} for {s} (--{s}-ratio {getattr(args, s + '_ratio')})"
                            for s, n in held.items() if n)
        raise PreprocessError(f"--input has {total} line{'s' * (total != 1)}: holding out {kept}, at least one "
                              f"line per ratio above 0, leaves none for train; give more text, or pass "
                              f"--valid/--test FILE")
    bounds = {"train": (0, n_train), "valid": (n_train, n_train + held["valid"]),
              "test": (n_train + held["valid"], total)}
    stats = {s: {"lines": 0, "nonblank": 0} for s in SPLITS}
    outs = {s: open(work / f"{s}.raw", "w", encoding="utf-8", newline="\n") for s in SPLITS}

    def put(split: str, text: str) -> None:
        outs[split].write(text.replace(NEL, " ") + "\n")
        stats[split]["lines"] += 1
        stats[split]["nonblank"] += bool(text.strip())

    try:
        g = 0  # global line index over the concatenated input
        for info in inputs:
            for _, text in iter_lines(info.path):
                put("train" if g < n_train else ("valid" if g < bounds["test"][0] else "test"), text)
                g += 1
        for split, infos in explicit.items():
            for info in infos or []:
                for _, text in iter_lines(info.path):
                    put(split, text)
    finally:
        for f in outs.values():
            f.close()
    for split in SPLITS:
        if explicit.get(split):
            stats[split]["source"] = [str(i.path) for i in explicit[split]]
        else:
            lo, hi = bounds[split]
            stats[split]["source"] = f"input lines {lo + 1}-{hi} of {total}" if hi > lo else None
        if stats[split]["source"] is not None and stats[split]["nonblank"] == 0:
            hint = {"train": "lower --valid-ratio/--test-ratio or give more text",
                    "valid": "raise --valid-ratio or pass --valid FILE",
                    "test": "raise --test-ratio or pass --test FILE"}[split]
            raise PreprocessError(f"the {split} split ({stats[split]['source']}) has no text; {hint}")
    log.info("split %d input lines: %s", total,
             ", ".join(f"{s} {stats[s]['lines']}" for s in SPLITS if stats[s]["source"] is not None))
    if stats["valid"]["source"] is None:
        log.warning("no valid split (--valid-ratio 0): fairseq-train will need --disable-validation")
    return stats


def run(args: argparse.Namespace) -> Path:
    """Do the whole pipeline for parsed ``args``; return the finished ``--destdir``."""
    _check_options(args)
    # Check every input before any work, so bad input fails fast with nothing written.
    inputs = check_text_files(args.input, "--input")
    explicit = {"valid": check_text_files(args.valid, "--valid") if args.valid else None,
                "test": check_text_files(args.test, "--test") if args.test else None}
    if args.spm_model is not None:
        vocab.load_spm(require_file(args.spm_model, "--spm-model"))
        log.info("reusing %s: --vocab-size, --model-type, --character-coverage, --spm-option and "
                 "--spm-input-sentence-size are not used", args.spm_model)
    spm_options = vocab.parse_spm_options(args.spm_option)
    # --spm-model is left out: the output keeps a copy of it at the same place
    texts = [(path, f"--{name}") for name in ("input", "valid", "test") for path in getattr(args, name) or []]
    check_destdir(args.destdir, args.force, texts)

    with staged_destdir(args.destdir, args.force) as stage:
        work = stage / "_work"
        work.mkdir()
        stats = _write_splits(inputs, explicit, args, work)
        splits = [s for s in SPLITS if stats[s]["source"] is not None]
        model_file = stage / vocab.MODEL_NAME
        if args.spm_model is not None:
            shutil.copyfile(args.spm_model, model_file)
            if args.spm_model.with_suffix(".vocab").is_file():
                shutil.copyfile(args.spm_model.with_suffix(".vocab"), model_file.with_suffix(".vocab"))
        else:
            names = [Path(p).name for p in args.input]
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            corpus = f"the {stats['train']['lines']} training lines of {shown}"
            vocab.train_spm(work / "train.raw", model_file.with_suffix(""), args.vocab_size,
                            args.model_type, args.character_coverage, corpus=corpus, threads=args.workers,
                            input_sentence_size=args.spm_input_sentence_size, extra=spm_options,
                            verbose=args.verbose)
        sp = vocab.load_spm(model_file, "sentencepiece model")
        if args.spm_model is None and sp.get_piece_size() < args.vocab_size:
            log.warning("sentencepiece made %d pieces, fewer than --vocab-size %d (a char model makes one "
                        "per character; with hard_vocab_limit=false the text may offer fewer)",
                        sp.get_piece_size(), args.vocab_size)
        counts = np.zeros(sp.get_piece_size(), dtype=np.int64)
        for split in splits:
            stats[split].update(vocab.encode_file(
                sp, work / f"{split}.raw", work / f"{split}.spm", stats[split]["lines"], f"encode {split}",
                threads=args.workers, counts=counts if split == "train" else None))
        vocab.write_dict(sp, work / "dict.txt", counts)
        binarize(work / "dict.txt", {s: work / f"{s}.spm" for s in splits}, stage, args.workers)
        shutil.rmtree(work)
        manifest = {
            "tool": "preprocess.text", "command": getattr(args, "command", None),
            "inputs": [str(p) for p in args.input],
            "splits": {s: stats[s] for s in splits},
            "sentencepiece": {"model": vocab.MODEL_NAME, "pieces": sp.get_piece_size(),
                              "model_type": args.model_type if args.spm_model is None else "reused",
                              "character_coverage": args.character_coverage if args.spm_model is None else None,
                              "reused_from": str(args.spm_model) if args.spm_model else None},
            "dictionary": {"file": "dict.txt", "ids": "fairseq id == sentencepiece id; 0-3 are "
                                                      "<s> <pad> </s> <unk>"},
        }
        (stage / "preprocess.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    summary = ", ".join(f"{s} {stats[s]['lines']} lines / {stats[s]['tokens']} tokens" for s in splits)
    print(f"done: {args.destdir}: {summary}; {sp.get_piece_size()} pieces "
          f"(dict.txt ids = sentencepiece ids)")
    return args.destdir


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry; returns the exit status (0 ok, 1 bad input, 2 bad usage)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = ["python", "-m", "preprocess.text", *argv]
    return run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
