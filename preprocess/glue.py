"""``python -m preprocess.glue``: GLUE-style TSV files -> the layout of fairseq's ``sentence_prediction``.

Output in ``--destdir``: ``input0/`` (first sentence), ``input1/`` (second sentence, pair tasks only)
and ``label/``, each with ``train``/``valid``/``test`` binaries and a ``dict.txt``: the inputs use the
pretrained model's ``dict.txt`` (so token ids match the checkpoint), ``label/dict.txt`` lists the
training labels in sorted order (class index = position). With ``--regression`` the labels are
written as ``label/{split}.label`` text, one float per line, as fairseq reads them. A test file whose
header lacks the label column is written without labels.
"""
import argparse
import json
import logging
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from preprocess import vocab
from preprocess.binarize import binarize
from preprocess.errors import PreprocessError, run_main
from preprocess.inputs import iter_lines, require_file
from preprocess.staging import check_destdir, staged_destdir

log = logging.getLogger("preprocess")


@dataclass
class Table:
    """The columns we need from one TSV file, with the file line of every row (for messages)."""

    path: Path
    sentence1: List[str] = field(default_factory=list)
    sentence2: Optional[List[str]] = None
    labels: Optional[List[str]] = None
    line_numbers: List[int] = field(default_factory=list)
    skipped: int = 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m preprocess.glue",
        description="GLUE-style TSV files -> input0/ input1/ label/ binaries for fairseq's "
                    "sentence_prediction task, encoded with a pretrained model's sentencepiece + dict.txt.")
    p.add_argument("--train", required=True, type=Path, help="training TSV")
    p.add_argument("--dev", "--valid", dest="dev", required=True, type=Path,
                   help="development TSV (written as the 'valid' split)")
    p.add_argument("--test", type=Path, help="test TSV (labels optional)")
    p.add_argument("--spm", required=True, type=Path, help="sentencepiece model of the pretrained LM "
                                                            "(sentencepiece.bpe.model from preprocess.text)")
    p.add_argument("--dict", required=True, type=Path, help="the pretrained LM's dict.txt")
    p.add_argument("--destdir", required=True, type=Path, help="output folder (created)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --destdir")
    c = p.add_argument_group("columns: header names or 0-based indices")
    c.add_argument("--columns", metavar="S1[,S2],LABEL",
                   help="shorthand: 'sentence,label' or 'sentence1,sentence2,label' (or indices '3,1')")
    c.add_argument("--sentence1-column", metavar="COL")
    c.add_argument("--sentence2-column", metavar="COL", help="omit for single-sentence tasks")
    c.add_argument("--label-column", metavar="COL")
    c.add_argument("--no-header", action="store_true",
                   help="the files have no header row (e.g. CoLA); columns must be indices")
    p.add_argument("--regression", action="store_true", help="labels are real numbers (e.g. STS-B)")
    p.add_argument("--label-divisor", type=float, default=1.0, metavar="D",
                   help="with --regression: write each label divided by D (fairseq's RoBERTa recipe takes "
                        "STS-B's 0-5 scores to 0-1 with 5)")
    p.add_argument("--skip-bad-rows", action="store_true",
                   help="skip rows with too few columns instead of failing (QQP has a few)")
    p.add_argument("--workers", type=int, default=1, help="processes for fairseq's binariser")
    return p


def _column_specs(args: argparse.Namespace) -> Tuple[str, Optional[str], str]:
    if args.columns:
        if args.sentence1_column or args.sentence2_column or args.label_column:
            raise PreprocessError("give either --columns or --sentence1/2-column and --label-column")
        parts = [c.strip() for c in args.columns.split(",")]
        if len(parts) not in (2, 3) or not all(parts):
            raise PreprocessError(f"--columns: expected 'S1,LABEL' or 'S1,S2,LABEL', got {args.columns!r}")
        return parts[0], (parts[1] if len(parts) == 3 else None), parts[-1]
    if not args.sentence1_column or not args.label_column:
        raise PreprocessError("say which columns to read: --columns S1[,S2],LABEL, or "
                              "--sentence1-column [--sentence2-column] --label-column")
    return args.sentence1_column, args.sentence2_column, args.label_column


def _resolve(spec: str, header: Optional[List[str]], path: Path, option: str) -> Optional[int]:
    """Column index for a name or an index; None when a name is not in the header."""
    if spec.isdecimal():  # isdigit() would take "²", which int() refuses
        return int(spec)
    if header is None:
        raise PreprocessError(f"{option} {spec!r} is a name, but --no-header says {path} has no header; "
                              f"use a 0-based column index")
    return header.index(spec) if spec in header else None


def read_table(path: Path, option: str, specs: Tuple[str, Optional[str], str], has_header: bool,
               label_required: bool, regression: bool, skip_bad: bool, label_divisor: float = 1.0) -> Table:
    """Read the needed columns of one TSV file, failing with file:line on anything malformed."""
    require_file(path, option)
    table = Table(path)
    lines = iter_lines(path)
    header = None
    if has_header:
        first = next(lines, None)
        if first is None:
            raise PreprocessError(f"{option}: file is empty (0 bytes): {path}")
        header = [h.strip() for h in first[1].split("\t")]
    names = ("--sentence1-column", "--sentence2-column", "--label-column")
    idx: List[Optional[int]] = []
    for spec, name in zip(specs, names):
        i = None if spec is None else _resolve(spec, header, path, name)
        if spec is not None and i is None and (name != "--label-column" or label_required):
            raise PreprocessError(f"{name} {spec!r} is not a column of {path}; its header has: "
                                  f"{', '.join(header or [])}")
        idx.append(i)
    i1, i2, il = idx
    if i2 is not None:
        table.sentence2 = []
    if il is not None:
        table.labels = []
    for number, text in lines:
        if not text.strip():
            continue  # trailing blank lines are common
        fields = text.split("\t")
        if il is not None and not label_required and not table.line_numbers and il >= len(fields):
            il, table.labels = None, None  # an unlabelled test file, told apart by its first row
        need = max(i for i in (i1, i2, il) if i is not None)
        if need >= len(fields):
            if skip_bad:
                table.skipped += 1
                continue
            raise PreprocessError(f"{path}:{number}: row has {len(fields)} tab-separated columns, column "
                                  f"{need} is needed (--skip-bad-rows skips such rows)")
        table.line_numbers.append(number)
        table.sentence1.append(fields[i1].strip())
        if i2 is not None:
            table.sentence2.append(fields[i2].strip())
        if il is not None:
            label = fields[il].strip()
            if regression:
                if not _is_number(label):
                    raise PreprocessError(f"{path}:{number}: label {label!r} is not a finite number "
                                          f"(--regression)")
                value = float(label)  # 15 digits where divided, as 4.2 / 5 reads 0.8400000000000001
                label = repr(value if label_divisor == 1 else float(f"{value / label_divisor:.15g}"))
            elif not label or label.split() != [label]:
                raise PreprocessError(f"{path}:{number}: label {label!r} is empty or contains spaces")
            table.labels.append(label)
    if not table.line_numbers:
        raise PreprocessError(f"{option}: no data rows in {path}")
    if header is not None and il is not None and table.labels and il < len(header):
        # a header's label column is a name (label, quality, ...): a data label there is a first row read as one
        name = header[il]
        if name in set(table.labels) or regression and _is_number(name):
            raise PreprocessError(f"{path}:1: read as the header, but its label column holds {name!r}, a label "
                                  "like the rows': the file has no header; pass --no-header (columns by number)")
    if table.skipped:
        log.warning("%s: skipped %d rows with too few columns", path, table.skipped)
    return table


def _is_number(text: str) -> bool:
    """A finite real number, as --regression takes a label."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _is_integer(text: str) -> bool:
    return text.lstrip("-").isdigit()


def _label_order(labels: List[str]) -> List[str]:
    """Sorted distinct labels (numerically when all are integers), so class ids are predictable."""
    distinct = set(labels)
    if all(map(_is_integer, distinct)):
        return sorted(distinct, key=int)
    return sorted(distinct)


def run(args: argparse.Namespace) -> Path:
    """Do the whole conversion for parsed ``args``; return the finished ``--destdir``."""
    if args.workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {args.workers}")
    if args.label_divisor != 1 and not args.regression:
        raise PreprocessError("--label-divisor divides real-valued labels: it needs --regression")
    if not 0 < args.label_divisor < math.inf:
        raise PreprocessError(f"--label-divisor must be a finite number > 0, got {args.label_divisor}")
    specs = _column_specs(args)
    sp = vocab.load_spm(require_file(args.spm, "--spm"), "--spm")
    vocab.check_dict_matches(sp, require_file(args.dict, "--dict"), "--dict")
    files = {"train": (args.train, "--train"), "valid": (args.dev, "--dev")}
    if args.test is not None:
        files["test"] = (args.test, "--test")
    check_destdir(args.destdir, args.force, [*files.values(), (args.spm, "--spm"), (args.dict, "--dict")])
    tables = {split: read_table(path, opt, specs, not args.no_header, split != "test", args.regression,
                                args.skip_bad_rows, args.label_divisor) for split, (path, opt) in files.items()}

    classes: Optional[List[str]] = None
    if not args.regression:
        classes = _label_order(tables["train"].labels)
        known = set(classes)
        for t in tables.values():
            for number, label in zip(t.line_numbers, t.labels or []):
                if label not in known:
                    real = all(map(_is_number, classes)) and not all(map(_is_integer, classes))
                    hint = "; the labels are real numbers: pass --regression (STS-B)" if real else ""
                    raise PreprocessError(f"{t.path}:{number}: label {label!r} never occurs in --train "
                                          f"(training labels: {', '.join(classes)}){hint}")

    with staged_destdir(args.destdir, args.force) as stage:
        work = stage / "_work"
        work.mkdir()
        for key, column in (("input0", "sentence1"), ("input1", "sentence2")):
            if getattr(tables["train"], column) is None:
                continue
            encoded = {}
            for split, t in tables.items():
                raw = work / f"{key}.{split}.raw"
                raw.write_text("".join(s + "\n" for s in getattr(t, column)), encoding="utf-8")
                encoded[split] = work / f"{key}.{split}.spm"
                vocab.encode_file(sp, raw, encoded[split], len(t.line_numbers), f"encode {key} {split}")
            binarize(args.dict, encoded, stage / key, args.workers)
        labelled = {split: t for split, t in tables.items() if t.labels is not None}
        (stage / "label").mkdir()
        if args.regression:
            for split, t in labelled.items():
                (stage / "label" / f"{split}.label").write_text("".join(l + "\n" for l in t.labels))
        else:
            counts = {c: tables["train"].labels.count(c) for c in classes}
            (work / "label.dict.txt").write_text("".join(f"{c} {counts[c]}\n" for c in classes))
            raw = {}
            for split, t in labelled.items():
                raw[split] = work / f"label.{split}.txt"
                raw[split].write_text("".join(l + "\n" for l in t.labels), encoding="utf-8")
            binarize(work / "label.dict.txt", raw, stage / "label", args.workers)
        shutil.rmtree(work)
        # beside the binaries, where the hubs' from_pretrained(..., data_bin) looks for the model to encode with
        shutil.copyfile(args.spm, stage / vocab.MODEL_NAME)
        manifest = {
            "tool": "preprocess.glue", "command": getattr(args, "command", None),
            "rows": {s: len(t.line_numbers) for s, t in tables.items()},
            "skipped_rows": {s: t.skipped for s, t in tables.items()},
            "pair": tables["train"].sentence2 is not None,
            "labelled_splits": sorted(labelled),
            "regression": args.regression,
            "label_divisor": args.label_divisor,
            "num_classes": 1 if args.regression else len(classes),
            "classes": classes,
        }
        (stage / "preprocess.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    rows = ", ".join(f"{s} {len(t.line_numbers)}" for s, t in tables.items())
    divided = f" (labels divided by {args.label_divisor:g})" if args.label_divisor != 1 else ""
    what = (f"regression{divided}: pass --regression-target --num-classes 1" if args.regression else
            f"{len(classes)} classes ({', '.join(f'{c}={i}' for i, c in enumerate(classes))}): "
            f"pass --num-classes {len(classes)}")
    print(f"done: {args.destdir}: rows {rows}; {what}")
    return args.destdir


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry; returns the exit status (0 ok, 1 bad input, 2 bad usage)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = ["python", "-m", "preprocess.glue", *argv]
    return run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
