"""Long Range Arena data -> fairseq binaries, once, for the ``lra_*`` tasks of lion_fairseq.

    python -m preprocess.lra listops    --input-dir lra_release/listops-1000 --destdir data-bin/lra/listops
    python -m preprocess.lra text       --imdb-dir aclImdb --destdir data-bin/lra/text
    python -m preprocess.lra text       --train train.tsv --valid dev.tsv --test test.tsv --destdir ...
    python -m preprocess.lra text       --input-dir DIR  (its train.tsv, dev.tsv, test.tsv) --destdir ...
    python -m preprocess.lra retrieval  --input-dir lra_release/tsv_data --destdir data-bin/lra/retrieval
    python -m preprocess.lra image      --input-dir cifar-10-batches-py --destdir data-bin/lra/image
    python -m preprocess.lra pathfinder --input-dir lra_release/pathfinder32 \\
                                        --difficulty curv_contour_length_14 --destdir data-bin/lra/pathfinder
    python -m preprocess.lra pathfinder --input-dir lra_release/pathfinder128 ... --destdir data-bin/lra/pathx

Inputs (the layouts of the LRA release, also used by the S4 and Mega code bases):

- listops (truncated to ``--max-length``, 2000, as LRA does): ``{prefix}_train.tsv``, ``{prefix}_val.tsv``, ``{prefix}_test.tsv`` (``Source<TAB>Target``
  with a header; ``python -m lion_fairseq.lra.listops`` writes the same). Tokens are the whitespace
  words without the tree's parentheses: digits, ``[MIN [MAX [MED [SM`` and ``]``.
- text: IMDB reviews, byte level (UTF-8 bytes), truncated to ``--max-length`` (4096); either the
  ``aclImdb`` folder (``{train,test}/{pos,neg}/*.txt``; valid = test, as LRA evaluates on test) or TSV
  files ``label<TAB>text`` (header optional).
- retrieval: ACL Anthology pairs ``new_aan_pairs.{train,eval,test}.tsv``: ``label<TAB>id1<TAB>id2<TAB>
  text1<TAB>text2``, no header; each document byte level, truncated to ``--max-length`` (4000).
- image: CIFAR-10 python batches (``data_batch_1..5``, ``test_batch``: pickled dicts with ``data``, 3072
  uint8 per image as R, G, B planes, and ``labels``), turned into 8-bit grayscale
  (``round(0.299 R + 0.587 G + 0.114 B)``) as LRA does, or ``--rgb`` (three tokens per pixel, R G B, so the
  sequence is 3072 long); valid = the last ``--valid-size`` (5000) training images.
- pathfinder (and Path-X at 128x128): ``{difficulty}/metadata/*.npy`` (text lines, image path in
  fields 0-1, label in field 3) and ``{difficulty}/imgs/*/*.png``; split in metadata order by
  ``--split`` (0.8 0.1 0.1). ``python -m lion_fairseq.lra.pathfinder`` writes a small synthetic set.

Output (``--destdir``): ``input0/{train,valid,test}.{bin,idx}`` + ``input0/dict.txt`` (and ``input1/`` for
retrieval's second document), ``label/{split}.{bin,idx}`` (one class index per item), and ``lra.json``
(kind, classes, max length, image size, counts) which the tasks read. Pixels and bytes share one
256-symbol dictionary (token id = value + 4, after fairseq's four specials). Sequences get no
``<s>``/``</s>``. Written into a hidden folder and renamed into place at the end (see README).
"""
import argparse
import json
import logging
import math
import pickle
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from preprocess.errors import PreprocessError, run_main
from preprocess.inputs import iter_lines
from preprocess.staging import check_destdir, staged_destdir

log = logging.getLogger("preprocess")
LISTOPS_VOCAB = tuple(str(d) for d in range(10)) + ("[MIN", "[MAX", "[MED", "[SM", "]")
SPLITS = ("train", "valid", "test")
# an item: one or two token-id sequences and a class index
Item = Tuple[Tuple[np.ndarray, ...], int]


def _dictionary(symbols: Sequence[str]):
    from fairseq.data import Dictionary

    d = Dictionary()
    for s in symbols:
        d.add_symbol(s)
    return d


def byte_dictionary():
    """The 256-symbol dictionary of bytes and 8-bit pixels: value v has id v + 4."""
    return _dictionary([str(v) for v in range(256)])


def listops_dictionary():
    return _dictionary(LISTOPS_VOCAB)


# ---- readers: each yields Items ------------------------------------------------------------------------

def _tsv_rows(path: Path, is_header: Callable[[List[str]], bool]) -> Iterator[Tuple[int, List[str]]]:
    """``(line number, fields)`` of each nonblank tab-separated line after an optional header (``is_header``
    of the first line's fields); lines end at ``\n`` only, as ``iter_lines`` reads them, so a stray ``\r``
    in a document stays in it."""
    if not path.is_file():
        raise PreprocessError(f"no such file: {path}")
    rows = 0
    for line, text in iter_lines(path):
        if not text.strip():
            continue  # blank lines, trailing ones above all, as preprocess.glue skips them
        row = text.split("\t")
        if line == 1 and is_header(row):
            continue
        rows += 1
        yield line, row
    if rows == 0:
        raise PreprocessError(f"{path}: no data rows")


def _label(value: str, path: Path, line: int, num_classes: int) -> int:
    try:
        as_float = float(value)
    except ValueError:
        raise PreprocessError(f"{path}:{line}: label {value!r} is not a number") from None
    label = int(as_float) if math.isfinite(as_float) else -1  # nan, inf: no class either
    if label != as_float or not 0 <= label < num_classes:
        raise PreprocessError(f"{path}:{line}: label {value!r} is not a class index in 0..{num_classes - 1}")
    return label


def _is_header(row: List[str]) -> bool:
    """Whether a first line's label field is not a number."""
    try:
        float(row[0])
        return False
    except ValueError:
        return True


def _nonempty(seq: np.ndarray, where: str) -> np.ndarray:
    if len(seq) == 0:
        raise PreprocessError(f"{where}: empty (an item needs at least one token)")
    return seq


def read_listops(path: Path, max_length: int) -> Iterator[Item]:
    ids = {s: i + 4 for i, s in enumerate(LISTOPS_VOCAB)}
    for line, row in _tsv_rows(path, lambda row: row[:2] == ["Source", "Target"]):
        if len(row) != 2:
            raise PreprocessError(f"{path}:{line}: expected 2 tab-separated columns (Source, Target); got {len(row)}")
        words = [w for w in row[0].split() if w not in ("(", ")")]
        unknown = sorted(set(words) - set(ids))
        if unknown:
            raise PreprocessError(f"{path}:{line}: unknown ListOps token(s) {unknown[:5]}")
        tokens = np.array([ids[w] for w in words[:max_length]], dtype=np.int64)
        yield (_nonempty(tokens, f"{path}:{line}: the expression"),), _label(row[1], path, line, 10)


def _bytes(text: str, max_length: int, where: str) -> np.ndarray:
    return _nonempty(np.frombuffer(text.encode("utf-8"), dtype=np.uint8)[:max_length].astype(np.int64) + 4, where)


def read_text_tsv(path: Path, max_length: int) -> Iterator[Item]:
    for line, row in _tsv_rows(path, _is_header):
        if len(row) < 2:
            raise PreprocessError(f"{path}:{line}: expected label<TAB>text; got {len(row)} column(s)")
        yield (_bytes("\t".join(row[1:]), max_length, f"{path}:{line}: the text"),), _label(row[0], path, line, 2)


def read_imdb(folder: Path, max_length: int) -> Iterator[Item]:
    files = []
    for label, name in ((0, "neg"), (1, "pos")):
        sub = folder / name
        if not sub.is_dir():
            raise PreprocessError(f"no such folder: {sub} (expected aclImdb/{{train,test}}/{{pos,neg}})")
        files += [(p, label) for p in sorted(sub.glob("*.txt"))]
    if not files:
        raise PreprocessError(f"{folder}: no pos/*.txt or neg/*.txt reviews")
    for p, label in files:
        yield (_bytes(p.read_text(encoding="utf-8", errors="replace"), max_length, str(p)),), label


def read_retrieval(path: Path, max_length: int) -> Iterator[Item]:
    for line, row in _tsv_rows(path, _is_header):
        if len(row) != 5:
            raise PreprocessError(f"{path}:{line}: expected 5 tab-separated columns "
                                  f"(label, id1, id2, text1, text2); got {len(row)}")
        docs = tuple(_bytes(row[i], max_length, f"{path}:{line}: text{i - 2}") for i in (3, 4))
        yield docs, _label(row[0], path, line, 2)


def _cifar_batch(path: Path) -> Tuple[np.ndarray, List[int]]:
    if not path.is_file():
        raise PreprocessError(f"no such file: {path} (expected the cifar-10-batches-py folder)")
    with open(path, "rb") as f:
        try:
            batch = pickle.load(f, encoding="bytes")
        except Exception as e:  # a truncated or foreign file
            raise PreprocessError(f"{path}: not a CIFAR-10 python batch ({e})") from e
    data, labels = batch.get(b"data"), batch.get(b"labels")
    if data is None or labels is None or np.asarray(data).shape[1:] != (3072,):
        raise PreprocessError(f"{path}: expected a dict with b'data' (N, 3072) and b'labels'")
    bad = next((label for label in labels if not 0 <= label < 10), None)
    if bad is not None:  # the training batches too: a -1 was written as 65535
        raise PreprocessError(f"{path}: label {bad} is not a CIFAR-10 class")
    return np.asarray(data, dtype=np.uint8), list(labels)


def cifar_tokens(data: np.ndarray, rgb: bool) -> np.ndarray:
    """``(N, 3072)`` uint8 R, G, B planes -> ``(N, 1024)`` grayscale token ids, or ``(N, 3072)`` with
    the three values of each pixel in a row (``rgb``); row-major pixel order either way."""
    planes = data.reshape(-1, 3, 1024).astype(np.float64)
    if rgb:
        return planes.transpose(0, 2, 1).reshape(-1, 3072).astype(np.int64) + 4
    gray = np.rint(planes[:, 0] * 0.299 + planes[:, 1] * 0.587 + planes[:, 2] * 0.114)
    return np.clip(gray, 0, 255).astype(np.int64) + 4


def read_cifar(paths: Sequence[Path], rgb: bool) -> Iterator[Item]:
    for path in paths:
        data, labels = _cifar_batch(path)
        for tokens, label in zip(cifar_tokens(data, rgb), labels):
            yield (tokens,), int(label)


def pathfinder_index(root: Path) -> List[Tuple[Path, int]]:
    """(image path, label) of every metadata line under ``root`` (= ``.../pathfinder32/curv_baseline``),
    metadata files in numeric order."""
    meta = root / "metadata"
    files = sorted(meta.glob("*.npy"), key=lambda p: (int(p.stem) if p.stem.isdigit() else 1 << 62, p.stem))
    if not files:
        parent = root.parent  # --input-dir: which difficulties it does hold
        found = sorted(p.name for p in parent.iterdir() if (p / "metadata").is_dir()) if parent.is_dir() else []
        hint = f"; --input-dir holds {', '.join(found)}: pass --difficulty {found[0]}" if found else ""
        raise PreprocessError(f"no metadata/*.npy under {root}{hint}")
    out = []
    for mf in files:
        for n, line in enumerate(mf.read_text().splitlines(), start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4:
                raise PreprocessError(f"{mf}:{n}: expected 'folder file ... label' (label in field 3)")
            out.append((root / fields[0] / fields[1], _label(fields[3], mf, n, 2)))
    return out


def read_image(path: Path) -> np.ndarray:
    """A grayscale image as ``(height, width)`` int64 pixels; a missing or unreadable file named."""
    from PIL import Image

    if not path.is_file():
        raise PreprocessError(f"no such image: {path}")
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("L"), dtype=np.int64)
    except OSError as e:  # PIL's UnidentifiedImageError too, and "image file is truncated", which names no file
        raise PreprocessError(f"{path}: not a readable image ({e})") from None


def read_pathfinder(index: Sequence[Tuple[Path, int]], size: int) -> Iterator[Item]:
    for path, label in index:
        pixels = read_image(path)
        if pixels.shape != (size, size):
            raise PreprocessError(f"{path}: image is {pixels.shape[1]}x{pixels.shape[0]}, and the first, "
                                  f"{index[0][0]}, {size}x{size}: the images must be of one size")
        yield (pixels.reshape(-1) + 4,), label


# ---- writer ----------------------------------------------------------------------------------------------

def write_split(items: Iterable[Item], stage: Path, split: str, n_inputs: int, vocab_size: int,
                what: str) -> Dict[str, int]:
    """Write one split's inputs and labels as fairseq mmap datasets; returns counts."""
    from fairseq.data import indexed_dataset

    builders = []
    for i in range(n_inputs):
        (stage / f"input{i}").mkdir(exist_ok=True)
        builders.append(indexed_dataset.make_builder(
            indexed_dataset.data_file_path(str(stage / f"input{i}" / split)), impl="mmap", vocab_size=vocab_size))
    (stage / "label").mkdir(exist_ok=True)
    labels = indexed_dataset.make_builder(indexed_dataset.data_file_path(str(stage / "label" / split)),
                                          impl="mmap", vocab_size=1000)
    n = tokens = longest = 0
    classes: Dict[int, int] = {}
    for seqs, label in items:
        if len(seqs) != n_inputs:
            raise PreprocessError(f"{what}: item {n} has {len(seqs)} inputs; expected {n_inputs}")
        for b, s in zip(builders, seqs):
            if len(s) == 0:
                raise PreprocessError(f"{what}: item {n} is empty")
            b.add_item(torch.from_numpy(np.ascontiguousarray(s)))
            tokens += len(s)
            longest = max(longest, len(s))
        labels.add_item(torch.tensor([label]))
        classes[label] = classes.get(label, 0) + 1
        n += 1
        if n % 20000 == 0:
            log.info("%s: %d items", what, n)
    if n == 0:
        raise PreprocessError(f"{what}: no items")
    for i, b in enumerate(builders):
        b.finalize(indexed_dataset.index_file_path(str(stage / f"input{i}" / split)))
    labels.finalize(indexed_dataset.index_file_path(str(stage / "label" / split)))
    log.info("%s: %d items, %d tokens, longest %d, classes %s", what, n, tokens, longest, dict(sorted(classes.items())))
    return {"items": n, "tokens": tokens, "longest": longest}


def convert(kind: str, splits: Dict[str, Callable[[], Iterable[Item]]], destdir: Path, force: bool,
            dictionary, n_inputs: int, num_classes: int, max_length: int,
            image_size: Optional[int] = None, channels: int = 1) -> Path:
    with staged_destdir(destdir, force) as stage:
        counts = {}
        for split, make in splits.items():
            counts[split] = write_split(make(), stage, split, n_inputs, len(dictionary), f"{kind} {split}")
        for i in range(n_inputs):
            dictionary.save(str(stage / f"input{i}" / "dict.txt"))
        meta = {"kind": kind, "num_classes": num_classes, "max_length": max_length, "inputs": n_inputs,
                "image_size": image_size, "channels": channels, "splits": counts,
                "command": " ".join(["python -m preprocess.lra"] + sys.argv[1:])}
        (stage / "lra.json").write_text(json.dumps(meta, indent=1) + "\n")
    summary = ", ".join(f"{s} {c['items']} items (longest {c['longest']})" for s, c in counts.items())
    print(f"done: {destdir}: {kind}, {summary}; {num_classes} classes")  # as preprocess.text and .glue end
    return destdir


# ---- commands --------------------------------------------------------------------------------------------

def _three(args: argparse.Namespace, names: Tuple[str, str, str]) -> Dict[str, Path]:
    """train/valid/test files: explicit --train/--valid/--test, else --input-dir with the release's names."""
    explicit = [args.train, args.valid, args.test]
    if any(explicit):
        if not all(explicit):
            raise PreprocessError("give all of --train, --valid and --test (or --input-dir)")
        return dict(zip(SPLITS, explicit))
    if args.input_dir is None:
        raise PreprocessError("give --input-dir, or --train, --valid and --test")
    return {s: args.input_dir / n for s, n in zip(SPLITS, names)}


def run(args: argparse.Namespace) -> Path:
    if args.max_length is not None and args.max_length < 1:
        raise PreprocessError(f"--max-length must be at least 1, got {args.max_length}")
    check_destdir(args.destdir, args.force, [(getattr(args, name), f"--{name.replace('_', '-')}")
                                             for name in ("input_dir", "imdb_dir", "train", "valid", "test")])
    if args.kind == "listops":
        files = _three(args, tuple(f"{args.prefix}_{s}.tsv" for s in ("train", "val", "test")))
        max_length = args.max_length or 2000
        splits = {s: (lambda p=p: read_listops(p, max_length)) for s, p in files.items()}
        return convert("listops", splits, args.destdir, args.force, listops_dictionary(), 1, 10, max_length)
    if args.kind == "text":
        max_length = args.max_length or 4096
        imdb = args.imdb_dir
        if imdb is None and args.input_dir is not None and (args.input_dir / "train" / "pos").is_dir():
            imdb = args.input_dir  # the aclImdb folder, given as --input-dir
        if imdb is None and args.input_dir is None and not any([args.train, args.valid, args.test]):
            raise PreprocessError("give --imdb-dir (the aclImdb folder), --input-dir (a folder of train.tsv, dev.tsv "
                                  "and test.tsv), or --train, --valid and --test")
        if imdb is not None:
            splits = {"train": lambda: read_imdb(imdb / "train", max_length),
                      "valid": lambda: read_imdb(imdb / "test", max_length),
                      "test": lambda: read_imdb(imdb / "test", max_length)}
        else:
            files = _three(args, ("train.tsv", "dev.tsv", "test.tsv"))
            splits = {s: (lambda p=p: read_text_tsv(p, max_length)) for s, p in files.items()}
        return convert("text", splits, args.destdir, args.force, byte_dictionary(), 1, 2, max_length)
    if args.kind == "retrieval":
        max_length = args.max_length or 4000
        files = _three(args, tuple(f"new_aan_pairs.{s}.tsv" for s in ("train", "eval", "test")))
        splits = {s: (lambda p=p: read_retrieval(p, max_length)) for s, p in files.items()}
        return convert("retrieval", splits, args.destdir, args.force, byte_dictionary(), 2, 2, max_length)
    if args.kind == "image":
        if args.input_dir is None:
            raise PreprocessError("give --input-dir, the cifar-10-batches-py folder")
        batches = [_cifar_batch(args.input_dir / f"data_batch_{i}") for i in range(1, 6)]
        data = np.concatenate([d for d, _ in batches])
        labels = [label for _, ls in batches for label in ls]
        cut = args.valid_size
        if not 0 <= cut < len(labels):
            raise PreprocessError(f"--valid-size {cut} must be below the {len(labels)} training images")
        test = [args.input_dir / "test_batch"]

        def part(lo: int, hi: int) -> Iterator[Item]:
            for tokens, label in zip(cifar_tokens(data[lo:hi], args.rgb), labels[lo:hi]):
                yield (tokens,), int(label)

        n = len(labels)
        splits = {"train": lambda: part(0, n - cut),
                  "valid": (lambda: part(n - cut, n)) if cut else (lambda: read_cifar(test, args.rgb)),
                  "test": lambda: read_cifar(test, args.rgb)}
        return convert("image", splits, args.destdir, args.force, byte_dictionary(), 1, 10,
                       3072 if args.rgb else 1024, image_size=32, channels=3 if args.rgb else 1)
    if args.kind == "pathfinder":
        if args.input_dir is None:
            raise PreprocessError("give --input-dir, e.g. lra_release/pathfinder32")
        index = pathfinder_index(args.input_dir / args.difficulty)
        height, size = read_image(index[0][0]).shape
        if height != size:
            raise PreprocessError(f"{index[0][0]}: image is {size}x{height}: Pathfinder images are square")
        fractions = np.array(args.split, dtype=np.float64)
        if len(fractions) != 3 or (fractions <= 0).any():
            raise PreprocessError("--split takes three positive fractions (train valid test)")
        bounds = (np.cumsum(np.concatenate([[0], fractions / fractions.sum()])) * len(index)).round().astype(int)
        parts = {s: index[bounds[i]:bounds[i + 1]] for i, s in enumerate(SPLITS)}
        empty = [s for s, part in parts.items() if not part]
        if empty:
            raise PreprocessError(f"--split {' '.join(map(str, args.split))} leaves {' and '.join(empty)} no image "
                                  f"of the {len(index)}: give each split a larger share")
        splits = {s: (lambda part=part: read_pathfinder(part, size)) for s, part in parts.items()}
        return convert("pathfinder", splits, args.destdir, args.force, byte_dictionary(), 1, 2, size * size,
                       image_size=size)
    raise PreprocessError(f"unknown kind {args.kind!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m preprocess.lra", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("kind", choices=("listops", "text", "retrieval", "image", "pathfinder"))
    p.add_argument("--destdir", required=True, type=Path)
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --destdir")
    p.add_argument("--input-dir", type=Path, help="the release folder of this kind (see above)")
    p.add_argument("--train", type=Path)
    p.add_argument("--valid", type=Path)
    p.add_argument("--test", type=Path)
    p.add_argument("--prefix", default="basic", help="listops: file prefix in --input-dir")
    p.add_argument("--imdb-dir", type=Path, help="text: the aclImdb folder")
    p.add_argument("--max-length", type=int, help="tokens kept per sequence: listops 2000, text 4096, retrieval 4000 "
                                                       "(bytes per document)")
    p.add_argument("--valid-size", type=int, default=5000, help="image: training images held out for valid "
                                                                  "(0: valid = test)")
    p.add_argument("--rgb", action="store_true", help="image: R, G, B tokens per pixel instead of grayscale")
    p.add_argument("--difficulty", default="curv_contour_length_14",
                   help="pathfinder: curv_baseline, curv_contour_length_9 or curv_contour_length_14")
    p.add_argument("--split", type=float, nargs=3, default=[0.8, 0.1, 0.1], help="pathfinder: train valid test")
    return p


# the kinds each kind-specific option applies to: given to another, it would be ignored without a word
APPLIES = {"train": ("listops", "text", "retrieval"), "valid": ("listops", "text", "retrieval"),
           "test": ("listops", "text", "retrieval"), "prefix": ("listops",), "imdb_dir": ("text",),
           "max_length": ("listops", "text", "retrieval"), "valid_size": ("image",), "rgb": ("image",),
           "difficulty": ("pathfinder",), "split": ("pathfinder",)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for dest, kinds in APPLIES.items():
        if args.kind not in kinds and getattr(args, dest) != parser.get_default(dest):
            parser.error(f"--{dest.replace('_', '-')} applies to {', '.join(kinds)}, not to {args.kind}"
                         + (" (its images keep every pixel)" if dest == "max_length" else ""))
    return run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
