"""Starting LION from a trained softmax model, measured at CPU scale:

    python -m lion_fairseq.benchmark.uptrain               # 3 seeds: 32 minutes on 2 shared cores

Per seed, on the demo's corpus at ``benchmark.quality``'s size (2 layers x 128, 2 heads, FFN 512, 16 x 128
tokens a batch, Adam at lr 1e-3, inverse_sqrt with 60 warm-up updates, dropout 0.1), all through
``fairseq-train`` as a user runs it:

- **teacher**: ``roberta`` trained ``--updates`` (N) updates;
- **converted, step 0**: the teacher's weights in ``lion_{lit,d,s}_tiny`` (``python -m lion_fairseq.convert``),
  before any update;
- **uptrained**: each of those trained U = N/10 updates (``--finetune-from-model`` the teacher);
- **transfer alone**: ``lion_s_tiny`` after U/2 updates of ``--criterion lion_attention_transfer`` (only the
  attention's q, k and gates move; everything else is the teacher's);
- **transfer, then uptrained**: that, then U/2 ordinary updates (U in all);
- **scratch**: ``lion_s_tiny`` from its own initialisation, U updates and N updates.

Every loss is the masked-LM loss in bits of ``fairseq-validate`` on the valid split, the same masks for
every model of a seed; learning curves come from ``fairseq-train``'s validations.

Then, as GLUE is done (``fairseq-train --task sentence_prediction`` with ``--restore-file`` and the
``--reset-*`` flags, RoBERTa's settings of ``user_dir_examples/glue/finetune.sh`` but lr 1e-3 and
``FT_UPDATES`` updates of 32 sentences), the teacher, the three uptrained models and LION-S from scratch
(U and N updates), and a ``roberta`` and a ``lion_s_tiny`` with no pretraining, are each fine-tuned on a
task built from the same corpus with a known answer: is a sentence's word order the original, or are
the words between its first and last shuffled (the first and last stay, so a capital or a full stop gives
nothing away). Its sentences (8 to 40 words) come from the corpus's train split for training, and from
its held-out valid and test splits, less any that the train split also holds, for the dev set (never
seen in pretraining); each is there once as it is and once shuffled. ``python -m preprocess.glue``
binarises them with the corpus's sentencepiece model and dictionary. The figure is the dev accuracy after
the last update (no checkpoint is chosen on the dev set).

Writes ``uptrain.md``, ``uptrain.json`` and ``uptrain.png`` into ``--out``."""
import argparse
import json
import os
import random
import re
import statistics
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..demo.commands import console, python_module, remove_tree, run, shown
from ..demo.train import json_record
from ..user_dir import path as user_dir_path
from .options import out_folder
from .plotting import pyplot
from .quality import TINY_ENC, TOKENS, curves, mean_curve, prepare_text, spread, train_command

ROWS = ["teacher", "lion_lit converted, step 0", "lion_d converted, step 0", "lion_s converted, step 0",
        "lion_lit uptrained", "lion_d uptrained", "lion_s uptrained", "lion_s transfer alone",
        "lion_s transfer, then uptrained", "lion_s scratch, U updates", "lion_s scratch, N updates"]
ROBERTA = ["--arch", "roberta", *TINY_ENC]
# the starting points fine-tuned on the word-order task: rows above (their checkpoints) and their archs
FINE_TUNED = {"teacher": ROBERTA, "lion_lit uptrained": ["--arch", "lion_lit_tiny"],
              "lion_d uptrained": ["--arch", "lion_d_tiny"], "lion_s uptrained": ["--arch", "lion_s_tiny"],
              "lion_s scratch, U updates": ["--arch", "lion_s_tiny"],
              "lion_s scratch, N updates": ["--arch", "lion_s_tiny"]}
# the same archs from their own initialisation: what the fine-tuning data alone teaches
UNTRAINED = {"roberta, no pretraining": ROBERTA, "lion_s, no pretraining": ["--arch", "lion_s_tiny"]}
# about 3 epochs of the task's 4154 training rows, at pretraining's lr. At lr 1e-4 (a tenth of it, nearer
# GLUE's ratio) 400 updates left every starting point but LION-S from scratch at N near chance (seed 1)
FT_UPDATES, FT_LR = 400, 1e-3
MIN_WORDS, MAX_WORDS = 8, 40  # a task sentence's length


def slug(name: str) -> str:
    """A row's name as a file-name part: ``"lion_s scratch, U updates"`` -> ``"lion_s_scratch_u_updates"``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower())


def by_model(rows: List[Dict]) -> Dict[str, List[Dict]]:
    """``rows`` grouped by their ``"model"``, in the order met."""
    by: Dict[str, List[Dict]] = {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    return by


def train(root: Path, data: Path, tag: str, flags: List[str], updates: int, seed: int, validate_every: int,
          warmup: int = 60, what: str = "mlm") -> Dict:
    """One ``fairseq-train`` run of benchmark.quality's masked LM (``what="mlm"``, its last checkpoint kept)
    or causal LM (``"lm"``, its best valid checkpoint kept): ``{"checkpoint", "curve", "seconds",
    "command"}``."""
    save = root / "checkpoints" / tag
    # ``flags`` last, so that they win (the transfer's criterion)
    argv = train_command(what, data, save, [], updates, seed, TOKENS, 1e-3, warmup, keep=True) + [
        "--validate-interval-updates", str(validate_every), "--save-interval-updates", str(10 ** 9), *flags]
    log, seconds = run(argv, root / "logs" / f"{tag}.log", what=f"training {tag}")
    kept = save / ("checkpoint_last.pt" if what == "mlm" else "checkpoint_best.pt")
    return {"checkpoint": kept, "curve": curves(log)["valid"], "seconds": round(seconds, 1), "command": shown(argv)}


def validate(root: Path, data: Path, checkpoint: Path, tag: str, seed: int) -> float:
    """The checkpoint's masked-LM loss (bits) on the valid split through ``fairseq-validate``."""
    argv = console("fairseq-validate") + [
        str(data), "--user-dir", user_dir_path(), "--path", str(checkpoint), "--task", "masked_lm",
        "--valid-subset", "valid", "--batch-size", "16", "--required-batch-size-multiple", "1",
        "--num-workers", "0", "--cpu", "--seed", str(seed), "--log-format", "json"]
    out, _ = run(argv, root / "logs" / f"{tag}_validate.log", what=f"validating {tag}")
    m = re.search(r"\"valid_loss\": \"([0-9.]+)\"", out) or re.search(r"\| loss ([0-9.]+)", out)
    if m is None:
        raise RuntimeError(f"fairseq-validate printed no loss for {tag}:\n{out[-2000:]}")
    return float(m.group(1))


def masked_lm_criterion(checkpoint: Path) -> Path:
    """A copy of an attention-transfer checkpoint whose config names the masked-LM criterion, since
    ``fairseq-validate`` scores with the criterion a checkpoint was trained with."""
    import torch

    from ..clear_errors import load_checkpoint_file

    state = load_checkpoint_file(str(checkpoint))
    state["cfg"]["criterion"] = {"_name": "masked_lm", "tpu": False}
    out = checkpoint.with_name("checkpoint_masked_lm.pt")
    torch.save(state, out)
    return out


def result_row(name: str, seed: int, checkpoint: Path, updates: int, loss: float,
               run_: Optional[Dict] = None) -> Dict:
    """One model's row, as ``table`` and ``plot`` read it (here and in ``benchmark.uptrain_lm``); ``run_``:
    what ``train`` returned, for its learning curve and command."""
    return {"model": name, "seed": seed, "updates": updates, "checkpoint": str(checkpoint), "loss": loss,
            "curve": run_["curve"] if run_ else [], "command": run_["command"] if run_ else None}


def one_seed(root: Path, data: Path, seed: int, N: int) -> List[Dict]:
    U = max(2, N // 10)
    every = max(1, U // 5)
    rows: List[Dict] = []

    def row(name: str, checkpoint: Path, updates: int, run_: Optional[Dict] = None) -> None:
        loss = validate(root, data, checkpoint, f"{slug(name)}_{seed}", seed)
        rows.append(result_row(name, seed, checkpoint, updates, loss, run_))

    teacher = train(root, data, f"teacher_{seed}", ROBERTA, N, seed, max(1, N // 10))
    row("teacher", teacher["checkpoint"], N, teacher)
    start = ["--finetune-from-model", str(teacher["checkpoint"])]
    for v in ("lit", "d", "s"):
        converted = root / "checkpoints" / f"{v}_converted_{seed}.pt"
        run(python_module("lion_fairseq.convert") + [str(teacher["checkpoint"]), str(converted), "--arch",
                                                      f"lion_{v}_tiny", "--data", str(data)],
            root / "logs" / f"{v}_convert_{seed}.log", what=f"converting to lion_{v}")
        row(f"lion_{v} converted, step 0", converted, 0)
        up = train(root, data, f"{v}_uptrained_{seed}", ["--arch", f"lion_{v}_tiny", *start], U, seed, every,
                   warmup=max(1, U // 10))
        row(f"lion_{v} uptrained", up["checkpoint"], U, up)
    transfer = train(root, data, f"s_transfer_{seed}", ["--arch", "lion_s_tiny", *start, "--criterion",
                     "lion_attention_transfer", "--teacher", str(teacher["checkpoint"])], U // 2, seed, U, warmup=1)
    row("lion_s transfer alone", masked_lm_criterion(transfer["checkpoint"]), U // 2, dict(transfer, curve=[]))
    after = train(root, data, f"s_transfer_up_{seed}", ["--arch", "lion_s_tiny", "--finetune-from-model",
                  str(transfer["checkpoint"])], U - U // 2, seed, every, warmup=max(1, U // 10))
    # its curve counts from the start of the transfer
    row("lion_s transfer, then uptrained", after["checkpoint"], U,
        dict(after, curve=[(u + U // 2, v) for u, v in after["curve"]]))
    for n, name in ((U, "lion_s scratch, U updates"), (N, "lion_s scratch, N updates")):
        scratch = train(root, data, f"s_scratch_{n}_{seed}", ["--arch", "lion_s_tiny"], n, seed, every if n == U
                        else max(1, N // 10))
        row(name, scratch["checkpoint"], n, scratch)
    return rows


def corpus_splits(root: Path, data: Path) -> Dict[str, List[str]]:
    """The corpus's lines in ``data``'s splits: ``prepare_text`` wrote the corpus to ``root/pydoc.txt``
    and ``preprocess.text`` cut it into train, valid and test, contiguous and in that order, counted in
    ``data/preprocess.json``."""
    lines = (root / "pydoc.txt").read_text(encoding="utf-8").splitlines()
    counts = json.loads((data / "preprocess.json").read_text())["splits"]
    out, start = {}, 0
    for split in ("train", "valid", "test"):
        out[split] = lines[start:start + counts[split]["lines"]]
        start += counts[split]["lines"]
    return out


def sentences(lines: List[str]) -> List[str]:
    """The sentences of ``lines`` (joined, cut after ``.``, ``!`` or ``?`` before a capital, quote, ``*``
    or bracket) of ``MIN_WORDS`` to ``MAX_WORDS`` words, with single spaces, whose inner words (all but
    the first and last) are not all the same, so that shuffling them changes the sentence."""
    text = " ".join(line.strip() for line in lines if line.strip())
    out = []
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"*(])", text):
        words = s.split()
        if MIN_WORDS <= len(words) <= MAX_WORDS and len(set(words[1:-1])) > 1:
            out.append(" ".join(words))
    return out


def shuffle_inner(sentence: str, rng: random.Random) -> str:
    """``sentence`` with the words between its first and last in another order; the first and last
    words stay, so the capital and the full stop do not tell the two apart."""
    words = sentence.split()
    inner = words[1:-1]
    while inner == words[1:-1]:
        rng.shuffle(inner)
    return " ".join([words[0], *inner, words[-1]])


def prepare_word_order(root: Path, data: Path) -> Path:
    """The word-order task (made once): ``train.tsv`` from the train split's sentences, ``dev.tsv`` from
    those of the held-out valid and test splits that are nowhere in the train split, each sentence once
    ``original`` and once ``shuffled`` (:func:`shuffle_inner`), binarised by ``python -m preprocess.glue``
    with ``data``'s sentencepiece model and ``dict.txt``. Returns that folder (``input0/``, ``label/``,
    ``preprocess.json``)."""
    task = root / "word_order"
    binarised = task / "bin"
    if (binarised / "preprocess.json").exists():
        return binarised
    task.mkdir(parents=True, exist_ok=True)
    splits = corpus_splits(root, data)
    seen = " ".join(" ".join(line.split()) for line in splits["train"])  # the text pretraining saw
    rng = random.Random(0)  # the same task for every seed and every run
    # the help topics repeat some sentences: a held-out one that pretraining saw is not held out
    held_out = [s for s in sentences(splits["valid"] + splits["test"]) if s not in seen]
    for name, chosen in (("train", sentences(splits["train"])), ("dev", held_out)):
        rows = [f"{s}\toriginal\n{shuffle_inner(s, rng)}\tshuffled" for s in chosen]
        (task / f"{name}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    run(python_module("preprocess.glue") + [
        "--train", str(task / "train.tsv"), "--dev", str(task / "dev.tsv"), "--columns", "sentence,label",
        "--spm", str(data / "sentencepiece.bpe.model"), "--dict", str(data / "dict.txt"),
        "--destdir", str(binarised), "--force"], root / "logs" / "preprocess_word_order.log",
        what="preprocessing the word-order task")
    return binarised


def dev_accuracy(log: str) -> float:
    """The dev accuracy (0-1) of the last validation in a ``fairseq-train --log-format json`` log."""
    found = [rec["valid_accuracy"] for rec in (json_record(line, "valid") for line in log.splitlines())
             if rec is not None and "valid_accuracy" in rec]
    if not found:
        raise RuntimeError(f"fairseq-train printed no valid_accuracy:\n{log[-2000:]}")
    return round(float(found[-1]) / 100, 4)  # fairseq logs it in percent, to 0.1


def fine_tune(root: Path, task: Path, tag: str, flags: List[str], checkpoint: Optional[Path], seed: int,
              updates: int = FT_UPDATES) -> Dict:
    """``fairseq-train --task sentence_prediction`` on ``task`` as the GLUE recipe runs it, from
    ``checkpoint`` (``--restore-file`` and the ``--reset-*`` flags; None: the arch's own initialisation);
    ``flags`` (the arch) last, so that they win. Keeps the last classifier in ``root/checkpoints/tag``.
    Returns ``{"accuracy": dev accuracy (0-1) after the last update, "checkpoint", "command"}``."""
    save = root / "checkpoints" / tag
    remove_tree(save)  # fairseq-train would resume from a checkpoint_last.pt left there by an earlier run
    start = ([] if checkpoint is None else
             ["--restore-file", str(checkpoint), "--reset-optimizer", "--reset-dataloader", "--reset-meters"])
    argv = console("fairseq-train") + [
        str(task), "--user-dir", user_dir_path(), *start, "--task", "sentence_prediction",
        "--criterion", "sentence_prediction", "--num-classes", "2", "--init-token", "0", "--separator-token", "2",
        # the pretraining length: the teacher's learned positions are that many
        "--max-positions", str(TOKENS), "--shorten-method", "truncate", "--batch-size", "32",
        "--required-batch-size-multiple", "1", "--dropout", "0.1", "--attention-dropout", "0.1",
        "--weight-decay", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6",
        "--lr-scheduler", "polynomial_decay", "--lr", str(FT_LR), "--total-num-update", str(updates),
        "--warmup-updates", str(max(1, updates * 6 // 100)), "--max-update", str(updates), "--seed", str(seed),
        "--save-dir", str(save), "--no-epoch-checkpoints", "--no-save-optimizer-state", "--num-workers", "0",
        "--cpu", "--log-format", "json", "--log-interval", "50", *flags]
    log, _ = run(argv, root / "logs" / f"{tag}.log", what=f"fine-tuning {tag}")
    return {"accuracy": dev_accuracy(log), "checkpoint": save / "checkpoint_last.pt", "command": shown(argv)}


def starting_points(rows: List[Dict]) -> List[Tuple[str, int, List[str], Optional[Path]]]:
    """(name, pretraining updates, arch flags, checkpoint or None) of everything fine-tuned for one seed's
    masked-LM ``rows``."""
    by = {r["model"]: r for r in rows}
    return ([(name, by[name]["updates"], flags, Path(by[name]["checkpoint"])) for name, flags in FINE_TUNED.items()]
            + [(name, 0, flags, None) for name, flags in UNTRAINED.items()])


def tuned_row(root: Path, task: Path, seed: int, name: str, updates: int, flags: List[str],
              checkpoint: Optional[Path]) -> Dict:
    """One row of the fine-tuning table: ``{"model", "seed", "updates" (of pretraining), "accuracy",
    "command"}``."""
    tuned = fine_tune(root, task, f"{slug(name)}_word_order_{seed}", flags, checkpoint, seed)
    return {"model": name, "seed": seed, "updates": updates, "accuracy": tuned["accuracy"],
            "command": tuned["command"]}


def run_seeds(out: Path, data: Path, task: Path, seeds: List[int], N: int) -> Tuple[List[Dict], List[Dict]]:
    """Every seed's masked-LM runs, then its fine-tunes, two fairseq commands at a time: a seed's
    fine-tunes are queued as soon as its checkpoints exist, so that they fill the core a last seed
    pretraining on its own leaves idle. Returns (masked-LM rows, fine-tuning rows), by seed."""
    with ThreadPoolExecutor(2) as pool:
        pretrained = [pool.submit(one_seed, out / f"seed{s}", data, s, N) for s in seeds]
        rows: List[Dict] = []
        queued = []
        for done in as_completed(pretrained):
            seed_rows = done.result()
            seed = seed_rows[0]["seed"]
            rows += seed_rows
            queued += [pool.submit(tuned_row, out / f"seed{seed}", task, seed, *start)
                       for start in starting_points(seed_rows)]
        tuned = [q.result() for q in queued]
    return sorted(rows, key=lambda r: r["seed"]), sorted(tuned, key=lambda r: r["seed"])


def table(rows: List[Dict]) -> str:
    by = by_model(rows)
    teacher = statistics.mean(r["loss"] for r in by["teacher"])
    lines = ["| model | updates | valid loss, bits (mean ± sd (min-max)) | vs teacher | seeds |",
             "|---|---:|---:|---:|---:|"]
    for name in [n for n in ROWS if n in by]:
        rs = by[name]
        mean = statistics.mean(r["loss"] for r in rs)
        lines.append(f"| {name} | {rs[0]['updates']} | {spread([r['loss'] for r in rs])} | "
                     f"{100 * (mean / teacher - 1):+.1f}% | {len(rs)} |")
    return "\n".join(lines)


def tuned_table(tuned: List[Dict]) -> str:
    """The fine-tuning rows as a table: dev accuracy in percent, mean ± sd (min-max) over seeds."""
    lines = ["| starting point | pretraining updates | dev accuracy, % (mean ± sd (min-max)) | seeds |",
             "|---|---:|---:|---:|"]
    for name, rs in by_model(tuned).items():
        accuracy = spread([100 * r["accuracy"] for r in rs], 1)
        lines.append(f"| {name} | {rs[0]['updates']} | {accuracy} | {len(rs)} |")
    return "\n".join(lines)


def plot(rows: List[Dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    by = by_model([r for r in rows if r["curve"] and r["model"] != "teacher" and "N updates" not in r["model"]])
    for name, rs in by.items():
        ax.plot(*mean_curve([r["curve"] for r in rs]), marker="o", label=name)
    teacher = statistics.mean(r["loss"] for r in rows if r["model"] == "teacher")
    ax.axhline(teacher, color="k", linestyle="--", label="teacher")
    ax.set_xlabel("update (after the start)")
    ax.set_ylabel("valid loss (bits, mean over seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def arguments(module: str, doc: str, updates: int, argv: Optional[List[str]]) -> Tuple[argparse.Namespace, Path]:
    """The command line of an uptraining benchmark (``--out``, ``--seeds``, ``--updates`` defaulting to
    ``updates``) and its output folder, made; each fairseq command it runs then takes one thread."""
    parser = argparse.ArgumentParser(prog=f"python -m lion_fairseq.benchmark.{module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=out_folder, default=f"outputs/benchmark/{module}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--updates", type=int, default=updates, help="the teacher's updates, N (uptraining: N/10)")
    args = parser.parse_args(argv)
    if args.updates < 20:
        parser.error(f"--updates must be at least 20 (uptraining takes a tenth of it); got {args.updates}")
    os.environ["OMP_NUM_THREADS"] = "1"  # each fairseq command on one thread, two seeds at a time
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, out


def main(argv: Optional[List[str]] = None) -> None:
    args, out = arguments("uptrain", __doc__, 1500, argv)
    data = prepare_text(out)
    task = prepare_word_order(out, data)
    rows, tuned = run_seeds(out, data, task, args.seeds, args.updates)
    (out / "uptrain.json").write_text(json.dumps({"masked_lm": rows, "word_order": tuned}, indent=1,
                                                 default=str))
    U = max(2, args.updates // 10)
    text = [f"### Starting LION from a RoBERTa teacher: N = {args.updates} teacher updates, U = {U}; seeds "
            f"{args.seeds}", "", table(rows)]
    if plot(rows, out / "uptrain.png"):
        text += ["", f"Learning curves: {out / 'uptrain.png'}"]
    text += ["", f"### Fine-tuned on the word-order task: {FT_UPDATES} updates of 32 sentences at lr {FT_LR:g}; "
             "dev accuracy after the last update (chance: 50%)", "", tuned_table(tuned)]
    text += ["", f"Commands (seed {args.seeds[0]}):", "", "```"]
    text += [r["command"] for r in rows + tuned if r["seed"] == args.seeds[0] and r["command"]] + ["```"]
    (out / "uptrain.md").write_text("\n".join(text) + "\n")
    print("\n" + "\n".join(text), flush=True)


if __name__ == "__main__":
    main()
