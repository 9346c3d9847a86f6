"""Language-model quality, LION against softmax attention at equal size, budget and optimiser:

    python -m lion_fairseq.benchmark.quality            # causal LM (lm), 3 seeds: about 22 min on 2 cores
    python -m lion_fairseq.benchmark.quality mlm        # masked LM: about 15 min
    python -m lion_fairseq.benchmark.quality recall     # multi-query associative recall, a known answer: about 20 min

``lm``: ``transformer_lm`` against ``lion_s_lm_tiny`` (the paper's LION-S) and ``lion_s_lm_plus_tiny`` (LION-S
with the levers: gate temperature, output gate, short convolution), all 2 layers x 128, 2 heads, FFN 512,
embeddings 128 wide, on the demo's corpus (Python's own help topics, ``lion_fairseq.demo.corpus``,
sentencepiece vocabulary of 4000, ``python -m preprocess.text``): ``--updates`` updates of 16 x 128 tokens,
Adam at lr 1e-3, inverse_sqrt with 60 warm-up updates, dropout 0.1, through ``fairseq-train``; the best
checkpoint's test loss (bits per token) through ``fairseq-eval-lm`` at ``--tokens-per-sample`` 128 (the
training length) and 512 (4x).

``mlm``: ``roberta`` at the same tiny size against ``lion_s_tiny`` (and it with the encoder's levers:
a centred convolution of 3 and the output gate), the best validation loss of ``fairseq-train --task
masked_lm``.

``recall``: multi-query associative recall (Zoology's MQAR), data written here (``--lines`` training
lines): each line holds ``--pairs`` key-value pairs (64 keys, 64 values), then every key again in a
shuffled order, each followed by its value; the model must recall the values. The same models as ``lm``,
dropout 0, 3000 updates at lr 3e-3 (200 warm-up). Scored as the accuracy of the values after the queries
(the known answer; chance is ``1 / VALUES``) on a held-out split, through the trained checkpoint.
Learning curves: the validation loss per epoch.

Each table gives the parameter count fairseq reports for each model.

``--add NAME "FLAGS"`` adds a model to the chosen comparison (e.g. one lever at a time: ``--add conv
"--arch lion_s_lm_tiny --lion-short-conv 4"``). Each (model, seed) is a ``fairseq-train`` run on one
thread, two at a time. Writes ``quality.md`` (tables, commands), ``quality.json`` and ``quality.png``
(learning curves, mean over seeds) into ``--out``/<what>."""
import argparse
import json
import os
import random
import re
import shlex
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..demo.commands import console, python_module, run, shown
from ..demo.corpus import write_pydoc_corpus
from ..demo.train import json_record
from ..user_dir import path as user_dir_path
from .options import out_folder, positive_int
from .plotting import pyplot

TOKENS = 128  # training length; eval-lm also runs at LONG = 4 x this
LONG = 4 * TOKENS
# transformer_lm's --decoder-input-dim and --decoder-output-dim default to 512 whatever the width: its
# embeddings would be 4x LION's (2.6M parameters against 0.9M at vocabulary 4000), so they are set too
TINY_LM = ["--decoder-layers", "2", "--decoder-embed-dim", "128", "--decoder-attention-heads", "2",
           "--decoder-ffn-embed-dim", "512", "--decoder-input-dim", "128", "--decoder-output-dim", "128"]
TINY_ENC = ["--encoder-layers", "2", "--encoder-embed-dim", "128", "--encoder-attention-heads", "2",
            "--encoder-ffn-embed-dim", "512"]
# (name, fairseq-train options that differ); everything else is common to the comparison
MODELS: Dict[str, List[Tuple[str, List[str]]]] = {
    "lm": [("transformer_lm", ["--arch", "transformer_lm", *TINY_LM]),
           ("lion_s_lm_tiny", ["--arch", "lion_s_lm_tiny"]),
           ("lion_s_lm_plus_tiny", ["--arch", "lion_s_lm_plus_tiny"])],
    "mlm": [("roberta", ["--arch", "roberta", *TINY_ENC]),
            ("lion_s_tiny", ["--arch", "lion_s_tiny"]),
            ("lion_s_tiny + conv 3 + output gate",
             ["--arch", "lion_s_tiny", "--lion-short-conv", "3", "--lion-output-gate"])],
    "recall": [("transformer_lm", ["--arch", "transformer_lm", *TINY_LM]),
               ("lion_s_lm_tiny", ["--arch", "lion_s_lm_tiny"]),
               ("lion_s_lm_plus_tiny", ["--arch", "lion_s_lm_plus_tiny"])],
}
# (updates, peak lr, warm-up updates) per comparison. Recall is learnt after a plateau: at lr 1e-3 and 600
# updates no model left chance (16 or 8 pairs a line); 4 pairs, 20000 lines, 3000 updates at 3e-3 separate them
SCHEDULE = {"lm": (600, 1e-3, 60), "mlm": (600, 1e-3, 60), "recall": (3000, 3e-3, 200)}
# MQAR: KEYS keys and VALUES values, disjoint symbols; a line is `k v k v ... | k v k v ...`
KEYS, VALUES = 64, 64
VOCAB = 4000


def prepare_text(root: Path) -> Path:
    """The demo's corpus, binarised with a sentencepiece vocabulary of ``VOCAB`` (made once)."""
    data = root / "data"
    if not (data / "test.bin").exists():
        corpus = write_pydoc_corpus(root / "pydoc.txt")
        run(python_module("preprocess.text") + [
            "--input", str(corpus), "--destdir", str(data), "--force", "--vocab-size", str(VOCAB),
            "--character-coverage", "0.9995", "--spm-option", "hard_vocab_limit=false", "--workers", "1"],
            root / "logs" / "preprocess.log", what="preprocessing")
    return data


def mqar_lines(n: int, pairs: int, rng: random.Random) -> List[str]:
    """``n`` lines of ``pairs`` distinct keys ``k0..`` with values ``v0..``, then the keys again shuffled,
    each followed by its value: ``4 * pairs`` words a line."""
    lines = []
    for _ in range(n):
        keys = rng.sample(range(KEYS), pairs)
        vals = [rng.randrange(VALUES) for _ in keys]
        order = list(range(pairs))
        rng.shuffle(order)
        words = [w for k, v in zip(keys, vals) for w in (f"k{k}", f"v{v}")]
        words += [w for i in order for w in (f"k{keys[i]}", f"v{vals[i]}")]
        lines.append(" ".join(words))
    return lines


def prepare_recall(root: Path, pairs: int, train_lines: int, seed: int = 0) -> Path:
    """MQAR text (train, valid, test) binarised with ``fairseq-preprocess --only-source`` (made once)."""
    data = root / f"data_{pairs}_{train_lines}"
    if not (data / "test.bin").exists():
        rng = random.Random(seed)
        text = root / f"text_{pairs}_{train_lines}"
        text.mkdir(parents=True, exist_ok=True)
        for split, n in (("train", train_lines), ("valid", 200), ("test", 200)):
            (text / f"{split}.txt").write_text("\n".join(mqar_lines(n, pairs, rng)) + "\n")
        run(console("fairseq-preprocess") + [
            "--only-source", "--trainpref", str(text / "train.txt"), "--validpref", str(text / "valid.txt"),
            "--testpref", str(text / "test.txt"), "--destdir", str(data), "--workers", "1"],
            root / "logs" / f"preprocess_{pairs}_{train_lines}.log", what="preprocessing")
    return data


def train_command(what: str, data: Path, save: Path, flags: List[str], updates: int, seed: int,
                  tokens: int, lr: float, warmup: int, keep: bool = False) -> List[str]:
    """``fairseq-train`` for one model of ``what``; only ``flags`` (the arch and its options) differ.
    ``keep``: a masked LM keeps its last checkpoint in ``save``."""
    argv = console("fairseq-train") + [str(data), "--user-dir", user_dir_path(), *flags]
    if what == "mlm":
        argv += ["--task", "masked_lm", "--criterion", "masked_lm"]
        argv += ["--save-dir", str(save), "--no-epoch-checkpoints"] if keep else ["--no-save"]
    else:
        # positions for eval-lm at 4x (transformer_lm's sinusoids; LION-S has none)
        argv += ["--task", "language_modeling", "--criterion", "cross_entropy", "--max-target-positions", str(LONG),
                 "--share-decoder-input-output-embed", "--save-dir", str(save), "--no-epoch-checkpoints",
                 "--no-last-checkpoints"]
    argv += ["--tokens-per-sample", str(tokens), "--sample-break-mode", "eos" if what == "recall" else "none",
             "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", str(lr), "--lr-scheduler", "inverse_sqrt",
             "--warmup-updates", str(warmup), "--dropout", "0.1" if what != "recall" else "0.0", "--batch-size", "16",
             # fairseq drops a last batch that is not a multiple of 8 (issue #5036), even in valid and test
             "--required-batch-size-multiple", "1", "--max-update", str(updates), "--seed", str(seed),
             "--num-workers", "0", "--cpu", "--log-format", "json", "--log-interval", "20"]
    return argv


def eval_lm_command(data: Path, checkpoint: Path, tokens: int, subset: str = "test") -> List[str]:
    return console("fairseq-eval-lm") + [
        str(data), "--user-dir", user_dir_path(), "--path", str(checkpoint), "--gen-subset", subset,
        "--tokens-per-sample", str(tokens), "--batch-size", "4", "--required-batch-size-multiple", "1",
        "--num-workers", "0", "--cpu"]


def curves(log: str) -> Dict[str, List[Tuple[int, float]]]:
    """(update, loss) of the training log's ``train_inner`` and ``valid`` records."""
    out: Dict[str, List[Tuple[int, float]]] = {"train": [], "valid": []}
    for line in log.splitlines():
        rec = json_record(line, "train_inner")
        if rec is not None:
            out["train"].append((int(float(rec["num_updates"])), float(rec["loss"])))
        rec = json_record(line, "valid")
        if rec is not None and "valid_loss" in rec:
            out["valid"].append((int(float(rec["valid_num_updates"])), float(rec["valid_loss"])))
    return out


def eval_loss(output: str) -> float:
    m = re.search(r"Loss \(base 2\): ([0-9.]+)", output)
    if m is None:
        raise RuntimeError(f"fairseq-eval-lm printed no loss:\n{output[-2000:]}")
    return float(m.group(1))


def recall_accuracy(data: Path, checkpoint: Path) -> float:
    """Greedy accuracy of the values after the queries (second half of each line) on the test split,
    in one teacher-forced pass of the trained model."""
    import torch
    from fairseq import checkpoint_utils

    import lion_fairseq  # noqa: F401  (registers the archs)

    torch.set_num_threads(1)
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)],
                                                                      arg_overrides={"data": str(data)})
    model = models[0].eval()
    d = task.source_dictionary
    right = total = 0
    lines = (data.parent / data.name.replace("data_", "text_", 1) / "test.txt").read_text().split("\n")
    with torch.no_grad():
        for line in filter(None, lines):
            ids = d.encode_line(line, add_if_not_exist=False, append_eos=False).long()
            prev = torch.cat([torch.tensor([d.eos()]), ids])[None]  # fairseq's LM data starts after an eos
            logits = model(prev)[0][0, :-1]  # predictions of ids[0..]
            half = len(ids) // 2
            at = torch.arange(half + 1, len(ids), 2)  # the values of the query half
            right += int((logits[at].argmax(-1) == ids[at]).sum())
            total += len(at)
    return right / total


def one_run(what: str, root: Path, data: Path, name: str, flags: List[str], updates: int, seed: int,
            tokens: int, lr: float, warmup: int) -> Dict:
    tag = f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}_{seed}"
    save = root / "checkpoints" / tag
    argv = train_command(what, data, save, flags, updates, seed, tokens, lr, warmup)
    log, seconds = run(argv, root / "logs" / f"{tag}.log", what=f"training {name}")
    count = re.search(r"num\. shared model params: ([0-9,]+)", log)
    row = {"model": name, "flags": flags, "seed": seed, "updates": updates, "train_s": round(seconds, 1),
           "params": int(count.group(1).replace(",", "")) if count else None,
           "curves": curves(log), "commands": [shown(argv)]}
    if what == "mlm":
        row["valid_loss"] = min(v for _, v in row["curves"]["valid"])
        return row
    ckpt = save / "checkpoint_best.pt"
    if what == "recall":
        row["valid_loss"] = min(v for _, v in row["curves"]["valid"])
        row["accuracy"] = recall_accuracy(data, ckpt)
        return row
    for length in (TOKENS, LONG):
        argv = eval_lm_command(data, ckpt, length)
        out, _ = run(argv, root / "logs" / f"{tag}_eval{length}.log", what=f"eval-lm {name}")
        row[f"test_{length}"] = eval_loss(out)
        row["commands"].append(shown(argv))
    return row


def spread(xs: Sequence[float], digits: int = 3) -> str:
    """mean ± sample standard deviation (min-max)."""
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.{digits}f} ± {sd:.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def table(what: str, rows: List[Dict]) -> str:
    keys = {"lm": [(f"test_{TOKENS}", f"test loss at {TOKENS}"), (f"test_{LONG}", f"test loss at {LONG}")],
            "mlm": [("valid_loss", "best valid loss")],
            "recall": [("accuracy", "recall accuracy"), ("valid_loss", "best valid loss")]}[what]
    by: Dict[str, List[Dict]] = {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    first = next(iter(by))
    base = statistics.mean(r[keys[0][0]] for r in by[first])
    lines = ["| model | " + " | ".join(t + " (mean ± sd (min-max))" for _, t in keys)
             + f" | vs {first} | params | seeds | train s |", "|---|" + "---:|" * (len(keys) + 4)]
    for name, rs in by.items():
        main = statistics.mean(r[keys[0][0]] for r in rs)
        lines.append(f"| {name} | " + " | ".join(spread([r[k] for r in rs]) for k, _ in keys)
                     + f" | {(100 * (main / base - 1)) if base else float('nan'):+.1f}% | {rs[0].get('params') or '-'} | "
                     f"{len(rs)} | {statistics.mean(r['train_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def mean_curve(curves: List[List[Tuple[int, float]]]) -> Tuple[List[int], List[float]]:
    """(updates, mean loss) over seeds, at the updates every seed logged."""
    pts: Dict[int, List[float]] = {}
    for curve in curves:
        for u, v in curve:
            pts.setdefault(u, []).append(v)
    xs = sorted(u for u, v in pts.items() if len(v) == len(curves))
    return xs, [statistics.mean(pts[u]) for u in xs]


def plot(what: str, rows: List[Dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    by: Dict[str, List[Dict]] = {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    for ax, split in zip(axes, ("train", "valid")):
        for name, rs in by.items():
            ax.plot(*mean_curve([r["curves"][split] for r in rs]), label=name)
        ax.set_xlabel("update")
        ax.set_ylabel(f"{split} loss (bits, mean over seeds)")
        ax.set_title(f"{what}: {split} loss")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def compare(what: str, out: Path, models: List[Tuple[str, List[str]]], seeds: List[int], updates: int,
            lr: float, warmup: int, pairs: int, lines: int) -> str:
    root = out / what
    root.mkdir(parents=True, exist_ok=True)
    if what == "recall":
        data, tokens = prepare_recall(out / "recall", pairs, lines), 4 * pairs + 1
    else:
        data, tokens = prepare_text(out), TOKENS
    jobs = [(name, flags, seed) for seed in seeds for name, flags in models]
    with ThreadPoolExecutor(2) as pool:  # two fairseq-train processes side by side, one thread each
        rows = list(pool.map(lambda j: one_run(what, root, data, j[0], j[1], updates, j[2], tokens, lr, warmup),
                             jobs))
    (root / "quality.json").write_text(json.dumps(rows, indent=1))
    setup = {"lm": f"causal LM, test loss in bits through fairseq-eval-lm at {TOKENS} and {LONG} tokens",
             "mlm": "masked LM, best validation loss in bits",
             "recall": f"MQAR, {pairs} pairs a line, {lines} training lines, accuracy of the recalled values "
                       "on the test split"}[what]
    text = [f"### {what}: {setup}; {updates} updates of 16 sequences, Adam at lr {lr:g} (inverse_sqrt, "
            f"{warmup} warm-up updates), seeds {seeds}", "", table(what, rows)]
    if plot(what, rows, root / "quality.png"):
        text += ["", f"Learning curves: {root / 'quality.png'}"]
    text += ["", "Commands (seed " + str(seeds[0]) + "):", "", "```"]
    text += [c for r in rows if r["seed"] == seeds[0] for c in r["commands"]] + ["```"]
    (root / "quality.md").write_text("\n".join(text) + "\n")
    return "\n".join(text)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", default=[],
                        help="comparisons to run: lm, mlm, recall (default: lm)")
    parser.add_argument("--out", type=out_folder, default="outputs/benchmark/quality")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--updates", type=positive_int, default=None, help="updates per model (default: lm and mlm "
                        f"{SCHEDULE['lm'][0]}, recall {SCHEDULE['recall'][0]})")
    parser.add_argument("--lr", type=float, default=None, help="Adam's peak learning rate (default: per comparison)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up updates (default: per comparison)")
    parser.add_argument("--pairs", type=positive_int, default=4, help="recall: key-value pairs a line")
    parser.add_argument("--lines", type=positive_int, default=20000, help="recall: training lines")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="only these of the standard models (none: only the --add ones)")
    parser.add_argument("--add", nargs=2, action="append", default=[], metavar=("NAME", "FLAGS"),
                        help='one more model: a name and its fairseq-train options, e.g. conv "--arch '
                             'lion_s_lm_tiny --lion-short-conv 4"')
    args = parser.parse_args(argv)
    whats = args.what or ["lm"]
    for what in whats:
        if what not in MODELS:
            parser.error(f"unknown comparison {what!r}: choose from {', '.join(MODELS)}")
    standard = {m[0] for what in whats for m in MODELS[what]}
    unknown = set(args.only or ()) - standard - {"none"}
    if unknown:
        parser.error(f"--only {' '.join(sorted(unknown))}: not a standard model of {', '.join(whats)} (they are "
                     f"{', '.join(sorted(standard))}; none: only the --add ones)")
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be > 0; got {args.lr}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0; got {args.warmup}")
    os.environ["OMP_NUM_THREADS"] = "1"  # each fairseq-train on one thread, two at a time
    out = Path(args.out)
    texts = []
    for what in whats:
        models = [m for m in MODELS[what] if args.only is None or m[0] in args.only]
        models += [(name, shlex.split(flags)) for name, flags in args.add]
        if not models:
            names = ", ".join(m[0] for m in MODELS[what])
            parser.error(f"--only {' '.join(args.only)}: none of {what}'s models ({names}), and no --add")
        updates, lr, warmup = SCHEDULE[what]
        texts.append(compare(what, out, models, args.seeds, args.updates or updates,
                             args.lr if args.lr is not None else lr,
                             args.warmup if args.warmup is not None else warmup, args.pairs, args.lines))
        print("\n" + texts[-1], flush=True)


if __name__ == "__main__":
    main()
