"""ListOps generator (Nangia & Bowman 2018, as used by Long Range Arena): nested list operations on the
digits 0-9, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]`` = 9, a 10-way classification of the value.

It writes the LRA release's layout, so the generated data and the downloaded ``lra_release/listops-1000``
go through the same ``preprocess/lra.py``: ``{task}_train.tsv``, ``{task}_val.tsv``, ``{task}_test.tsv``,
each with a ``Source<TAB>Target`` header and one expression per row in the release's bracketed form,
``( ( ( [MAX 2 ) 9 ) ] )`` for ``[MAX 2 9 ]`` (the parentheses are the binarised tree; the model never
sees them). The length of an expression is its token count without parentheses (values, operators and
``]``), as LRA counts it; LRA keeps expressions of 500 to 2000 tokens.

Trees grow as LRA's do: a node above ``--max-depth`` is an operator with probability ``--op-prob``
(0.25) with 2 to ``--max-args`` arguments, otherwise a digit; trees outside the length range are drawn
again (and abandoned as soon as they grow too long, which keeps the rejection cheap). Expressions are
unique across the three splits.

    python -m lion_fairseq.lra.listops --output-dir listops --num-train 96000 --num-valid 2000 --num-test 2000
"""
import argparse
import csv
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"

Tree = Union[int, Tuple[str, List["Tree"]]]


class _TooLong(Exception):
    pass


def random_tree(rng: random.Random, max_depth: int = 10, max_args: int = 10, op_prob: float = 0.25,
                max_length: Optional[int] = None) -> Tuple[Tree, int]:
    """A random expression tree and its length in tokens; raises ``_TooLong`` past ``max_length``."""
    budget = [0]

    def grow(depth: int) -> Tree:
        if depth < max_depth and rng.random() < op_prob:
            budget[0] += 2  # the operator and its ]
            if max_length is not None and budget[0] > max_length:
                raise _TooLong
            op = rng.choice(OPERATORS)
            return op, [grow(depth + 1) for _ in range(rng.randint(2, max_args))]
        budget[0] += 1
        if max_length is not None and budget[0] > max_length:
            raise _TooLong
        return rng.randrange(10)

    tree = grow(1)
    return tree, budget[0]


def evaluate(tree: Tree) -> int:
    """The value 0-9 of an expression: MIN, MAX, MED (median, truncated to an integer as LRA does with
    ``int(np.median)``) and SM (sum modulo 10)."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    values = sorted(evaluate(a) for a in args)
    if op == "[MIN":
        return values[0]
    if op == "[MAX":
        return values[-1]
    if op == "[SM":
        return sum(values) % 10
    n = len(values)  # [MED
    return values[n // 2] if n % 2 else int((values[n // 2 - 1] + values[n // 2]) / 2)


def tokens(tree: Tree) -> List[str]:
    """Prefix tokens without parentheses: what the model reads, e.g. ``[MAX 2 9 ]``."""
    out: List[str] = []

    def walk(t: Tree) -> None:
        if isinstance(t, int):
            out.append(str(t))
            return
        out.append(t[0])
        for a in t[1]:
            walk(a)
        out.append(END)

    walk(tree)
    return out


def to_release_string(tree: Tree) -> str:
    """The LRA release's bracketed form: an operator with n arguments opens n + 1 parentheses and closes
    one after each argument and one after its ``]``."""
    if isinstance(tree, int):
        return str(tree)
    op, args = tree
    parts = ["("] * (len(args) + 1) + [op]
    for a in args:
        parts += [to_release_string(a), ")"]
    parts += [END, ")"]
    return " ".join(parts)


# draws without a new expression before giving up: runs of a few hundred are usual (the defaults: about 50)
MAX_MISSES = 1_000_000


def generate(n: int, rng: random.Random, *, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
             max_args: int = 10, op_prob: float = 0.25, seen: Optional[set] = None) -> List[Tuple[str, int]]:
    """``n`` unique ``(release string, value)`` pairs with ``min_length <= length <= max_length``."""
    if min_length > max_length:
        raise ValueError(f"--min-length {min_length} is above --max-length {max_length}")
    seen = set() if seen is None else seen
    out: List[Tuple[str, int]] = []
    misses = 0  # draws since the last new expression: settings that allow none (or no more) would loop forever
    while len(out) < n:
        if misses == MAX_MISSES:
            raise ValueError(f"no new expression of {min_length} to {max_length} tokens in {MAX_MISSES:,} draws "
                             f"(--max-depth {max_depth}, --max-args {max_args}, --op-prob {op_prob}; {len(out)} of "
                             f"{n} made): these settings make none, or no more distinct ones. Raise --max-depth, "
                             "--max-args or --op-prob, widen --min-length/--max-length, or ask for fewer")
        misses += 1
        try:
            tree, length = random_tree(rng, max_depth, max_args, op_prob, max_length)
        except _TooLong:
            continue
        if length < min_length:
            continue
        text = to_release_string(tree)
        if text in seen:
            continue
        seen.add(text)
        out.append((text, evaluate(tree)))
        misses = 0
    return out


def write_tsv(rows: Sequence[Tuple[str, int]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(["Source", "Target"])
        writer.writerows(rows)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.lra.listops", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output-dir", required=True, type=Path)
    p.add_argument("--task", default="basic", help="file prefix: {task}_train.tsv etc., as the LRA release")
    p.add_argument("--num-train", type=int, default=96000)
    p.add_argument("--num-valid", type=int, default=2000)
    p.add_argument("--num-test", type=int, default=2000)
    p.add_argument("--min-length", type=int, default=500, help="fewest tokens (without parentheses)")
    p.add_argument("--max-length", type=int, default=2000, help="most tokens (without parentheses)")
    p.add_argument("--max-depth", type=int, default=10)
    p.add_argument("--max-args", type=int, default=10)
    p.add_argument("--op-prob", type=float, default=0.25, help="probability that a node is an operator")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_args < 2:
        p.error("--max-args must be at least 2")
    if args.min_length > args.max_length:
        p.error(f"--min-length {args.min_length} is above --max-length {args.max_length}")
    rng = random.Random(args.seed)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    seen: set = set()
    start = time.time()
    for split, n in (("train", args.num_train), ("val", args.num_valid), ("test", args.num_test)):
        try:
            rows = generate(n, rng, min_length=args.min_length, max_length=args.max_length, max_depth=args.max_depth,
                            max_args=args.max_args, op_prob=args.op_prob, seen=seen)
        except ValueError as e:
            p.error(f"{split}: {e}")
        path = args.output_dir / f"{args.task}_{split}.tsv"
        write_tsv(rows, path)
        labels = Counter(v for _, v in rows)
        lengths = sorted(len(tokens_of(s)) for s, _ in rows) or [0]
        print(f"{path}: {len(rows)} expressions, tokens min/median/max {lengths[0]}/{lengths[len(lengths) // 2]}/"
              f"{lengths[-1]}, labels {dict(sorted(labels.items()))} ({time.time() - start:.0f}s)", file=sys.stderr)


def tokens_of(release_string: str) -> List[str]:
    """The model's tokens of a release string: whitespace split, parentheses dropped."""
    return [t for t in release_string.split() if t not in ("(", ")")]


if __name__ == "__main__":
    main()
