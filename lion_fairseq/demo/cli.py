"""``python -m lion_fairseq.demo [--corpus FILE...] [--workdir outputs/demo] [--minutes 2.5]``: the steps
in order, what a second run reuses, and the summary printed at the end (also ``results.json``)."""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from lion_fairseq.demo import corpus as corpus_mod
from lion_fairseq.demo import decode, evaluate, plot
from lion_fairseq.demo.commands import REPO_ROOT, DemoError, python_module, quiet_logs, remove_tree, run, shown
from lion_fairseq.demo.train import CHECKPOINT, LM, MLM, Model, Progress, train_command
from lion_fairseq.demo.workdir import MARKER, Workdir, fingerprint

STEPS = 6


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m lion_fairseq.demo",
        description="Train tiny LION-S masked and causal language models on CPU in a few minutes, with no "
                    "download: preprocess a corpus (Python's own help text by default), fairseq-train both, "
                    "evaluate each in the parallel, chunk and recurrent forms, fill a mask, generate text "
                    "with recurrent decoding, and plot the loss curves.")
    p.add_argument("--corpus", nargs="+", metavar="FILE",
                   help="your own UTF-8 text files (one sentence or paragraph per line) instead of "
                        "pydoc_data.topics; the last lines are held out for validation")
    p.add_argument("--workdir", type=Path, default=Path("outputs/demo"),
                   help="where everything goes (default outputs/demo); a second run reuses what is "
                        "still valid there")
    p.add_argument("--minutes", type=float, default=2.5,
                   help="training time of each model in minutes (default 2.5; the whole demo takes about "
                        "2 x this plus 1-2 minutes)")
    p.add_argument("--max-update", type=int, default=0,
                   help="also stop each training after this many updates (default 0: time budget only)")
    p.add_argument("--vocab-size", type=int, default=2000,
                   help="sentencepiece vocabulary (default 2000; fewer pieces are used if the corpus is small)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences of 128 tokens per update (default 16)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process (default 1: tiny models gain little from more, and one thread "
                        "is not slowed down by other work on a busy machine)")
    p.add_argument("--seed", type=int, default=1, help="random seed of training and sampling (default 1)")
    p.add_argument("--mask-prompt", help="sentence with one <mask> for the masked LM (default: one from the corpus)")
    p.add_argument("--prompt", help="beginning of text for the causal LM to continue (default: from the corpus)")
    p.add_argument("--fresh", action="store_true", help="delete the workdir's previous results and redo everything")
    return p


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the option for a value that cannot work."""
    if not (args.minutes > 0 and math.isfinite(args.minutes)):
        raise ValueError(f"--minutes must be a positive number, got {args.minutes}")
    if args.max_update < 0:
        raise ValueError(f"--max-update must be >= 0, got {args.max_update}")
    if args.vocab_size < 100:
        raise ValueError(f"--vocab-size must be at least 100, got {args.vocab_size}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if not 0 <= args.seed < 2 ** 32:  # numpy's seeds; checked here, not after the preprocessing
        raise ValueError(f"--seed must be in 0..{2 ** 32 - 1}, got {args.seed}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.mask_prompt is not None and args.mask_prompt.count("<mask>") != 1:
        raise ValueError(f"--mask-prompt needs exactly one <mask>, got {args.mask_prompt!r}")
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt must not be empty")
    inside = args.fresh and next((f for f in args.corpus or () if Path(f).resolve().is_relative_to(
        args.workdir.resolve())), None)
    if inside:  # what --fresh removes
        raise ValueError(f"--corpus {inside} lies inside --workdir {args.workdir}, which --fresh removes: move "
                         "the file out of it, or leave --fresh out")
    if not (REPO_ROOT / "preprocess" / "text.py").is_file():
        raise ValueError(f"the demo needs the checkout's preprocess/ package (python -m preprocess.text), "
                         f"not found beside {REPO_ROOT / 'lion_fairseq'}: run it from a lion-fairseq checkout")


def step(n: int, title: str) -> None:
    """Print the header of step ``n``."""
    print(f"\n[{n}/{STEPS}] {title}", flush=True)


class Demo:
    """The demo's state: options, folders and results, filled in step by step."""

    def __init__(self, args: argparse.Namespace):
        import lion_fairseq  # registers the models (the hub needs them in this process)
        import torch

        torch.set_num_threads(args.threads)

        self.args = args
        self.work = Workdir(args.workdir)
        self.user_dir = str(Path(lion_fairseq.__file__).resolve().parent)
        self.data = self.work.root / "data-bin"
        self.tensorboard = self.work.root / "tensorboard"
        self.results: Dict[str, Any] = {"workdir": str(self.work.root)}

    # -- 1: corpus ------------------------------------------------------------------------------
    def corpus(self) -> List[Path]:
        """The text files to train on (pydoc's topics written to the workdir, or ``--corpus``) and the prompts."""
        step(1, "corpus")
        if self.args.corpus:
            files = corpus_mod.check_corpus_files(self.args.corpus)
            mask_prompt, lm_prompt = corpus_mod.prompts_from_text(files)
            source = ", ".join(shown([str(f)]) for f in files)
        else:
            files = [corpus_mod.write_pydoc_corpus(self.work.root / "corpus" / "pydoc_topics.txt")]
            mask_prompt, lm_prompt = corpus_mod.PYDOC_MASK_PROMPT, corpus_mod.PYDOC_LM_PROMPT
            source = f"pydoc_data.topics (Python {sys.version.split()[0]}'s help text) -> {shown([str(files[0])])}"
        self.mask_prompt = self.args.mask_prompt or mask_prompt
        self.lm_prompt = self.args.prompt or lm_prompt or "The"
        n_lines = n_words = 0
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    n_lines += 1
                    n_words += len(line.split())
        print(f"  {source}: {n_lines} lines, {n_words} words")
        self.results["corpus"] = {"files": [str(f) for f in files], "lines": n_lines, "words": n_words}
        return files

    # -- 2: sentencepiece + binaries ------------------------------------------------------------
    def preprocess(self, files: List[Path]) -> str:
        """sentencepiece + binaries into ``data-bin/`` (or reuse them); returns the stage's key."""
        step(2, "sentencepiece + fairseq binaries (python -m preprocess.text)")
        argv = python_module("preprocess.text") + [
            "--input", *map(str, files), "--destdir", str(self.data), "--force",
            "--vocab-size", str(self.args.vocab_size), "--character-coverage", "0.9995",
            # a small --corpus gets fewer pieces instead of an error
            "--spm-option", "hard_vocab_limit=false"]
        key = fingerprint("data", argv[1:], files=files)  # the options and the corpus bytes, not the python
        argv += ["--workers", str(min(4, os.cpu_count() or 1))]  # changes the speed, not the output
        outputs = [self.data / n for n in ("dict.txt", "train.bin", "valid.bin", "sentencepiece.bpe.model")]
        if self.work.done("data", key, *outputs):
            print(f"  reusing {shown([str(self.data)])} (same corpus and options)")
        else:
            self.work.forget("data")
            out, seconds = run(argv, self.work.root / "logs" / "preprocess.log", what="preprocessing",
                               threads=self.args.threads)
            summary = [line for line in out.splitlines() if line.startswith("done:")]
            print("  " + (summary[-1] if summary else f"wrote {self.data}") + f" ({seconds:.0f}s)")
            self.work.record("data", key)
        n_dict = sum(1 for _ in open(self.data / "dict.txt", encoding="utf-8"))
        # fairseq's dictionary = its 4 specials + dict.txt (+ <mask> for the masked LM)
        self.uniform_bits = math.log2(n_dict + 4)
        return key

    # -- 3, 4: training ---------------------------------------------------------------------------
    def train(self, n: int, model: Model, data_key: str) -> None:
        """``fairseq-train`` one model into ``<workdir>/<mlm|lm>/`` (or reuse it)."""
        step(n, f"training the {model.title} {model.arch} (fairseq-train, "
                f"{self.args.minutes:g} min{f' or {self.args.max_update} updates' if self.args.max_update else ''})")
        save_dir = self.work.root / model.name
        tb = self.tensorboard / model.name
        argv = train_command(model, self.data, self.user_dir, save_dir, tb, self.args.minutes,
                             self.args.max_update, self.args.batch_size, self.args.seed)
        key = fingerprint(model.name, data_key, argv)
        checkpoint = save_dir / CHECKPOINT
        record = self.work.done(model.name, key, checkpoint)
        if record:
            print(f"  reusing {shown([str(checkpoint)])} ({record['updates']} updates; --fresh to retrain)")
        else:
            # a clean start: no half-trained checkpoint for fairseq to resume, no stale curves
            self.work.forget(model.name)
            remove_tree(save_dir)
            remove_tree(tb)
            progress = Progress(model.name.upper(), self.args.minutes)
            _, seconds = run(argv, self.work.root / "logs" / f"train_{model.name}.log", on_line=progress,
                             threads=self.args.threads,
                             what=f"training the {model.title}")
            if not checkpoint.exists():
                raise DemoError(f"fairseq-train finished without writing {checkpoint}")
            record = {"updates": progress.updates, "seconds": round(seconds, 1), "best_valid_loss": progress.best}
            print(f"  trained {record['updates']} updates in {record['seconds']:.0f}s; best validation loss "
                  f"{progress.best if progress.best is not None else float('nan'):.3f} -> {shown([str(checkpoint)])}")
            self.work.record(model.name, key, **record)
        self.results[model.name] = {"arch": model.arch, "checkpoint": str(checkpoint), "updates": record["updates"]}

    # -- 5: evaluation in each form ---------------------------------------------------------------
    def evaluate(self, model: Model) -> Dict[str, float]:
        """Validation loss (bits per token) of ``model``'s best checkpoint in each form: ``{form: loss}``."""
        checkpoint = self.work.root / model.name / CHECKPOINT
        # the checkpoint's bytes, not the training command: a run trains for --minutes, so the same command
        # retrained (after Ctrl-C, or a lost file) makes another checkpoint
        scored = fingerprint(files=[checkpoint])
        losses = {}
        for form in evaluate.FORMS:
            argv = evaluate.eval_command(model, self.data, self.user_dir, checkpoint, form, self.args.batch_size)
            stage = f"eval_{model.name}_{form}"
            key = fingerprint(stage, scored, argv)
            record = self.work.done(stage, key)
            if record:
                print(f"  {model.name.upper():3} {form:9} loss {record['loss']:.4f}  (reused; same checkpoint)")
            else:
                out, seconds = run(argv, self.work.root / "logs" / f"{stage}.log", threads=self.args.threads,
                                   what=f"evaluating the {model.title} ({form})")
                try:
                    loss = evaluate.parse_loss(model, out)
                except ValueError as e:
                    raise DemoError(f"{e}; see {self.work.root / 'logs' / f'{stage}.log'}") from None
                print(f"  {model.name.upper():3} {form:9} loss {loss:.4f}  ({seconds:.0f}s)")
                record = {"loss": loss}
                self.work.record(stage, key, loss=loss)
            losses[form] = record["loss"]
        self.results[model.name]["valid_loss_bits"] = losses
        return losses

    # -- 6: using the models ----------------------------------------------------------------------
    def use(self) -> None:
        """Fill the mask and generate text through the hub interfaces, in this process."""
        step(6, "using the models from Python (hub interface, recurrent form)")
        mlm_ckpt = self.work.root / "mlm" / CHECKPOINT
        lm_ckpt = self.work.root / "lm" / CHECKPOINT
        print(f"  fill-mask: {self.mask_prompt}")
        with quiet_logs():
            filled = decode.fill_mask(mlm_ckpt, self.data, self.mask_prompt)
        for sentence, prob, token in filled:
            print(f"    {prob:6.3f}  {token!r:14}  {sentence}")
        self.results["fill_mask"] = {"input": self.mask_prompt,
                                     "top": [{"token": t, "prob": p, "filled": s} for s, p, t in filled]}
        layers, heads, floats = decode.state_floats(lm_ckpt)
        print(f"  generate: {self.lm_prompt!r}  (recurrent decoding: the state is {heads} heads x "
              f"{floats // heads} floats per layer, {layers} layers, whatever the context length)")
        with quiet_logs():
            out = decode.generate(lm_ckpt, self.data, self.lm_prompt, seed=self.args.seed)
        print(f"    sampled (top-10): {out['sampled']}")
        print(f"    beam 4          : {out['beam']}")
        self.results["generate"] = dict(out, prompt=self.lm_prompt)

    def plot(self) -> Path:
        """Write ``tensorboard/loss_curves.png`` from both trainings' logs; returns its path."""
        panels = []
        with quiet_logs():
            for model in (MLM, LM):
                curves, source = plot.read_curves(self.tensorboard / model.name,
                                                  self.work.root / "logs" / f"train_{model.name}.log")
                panels.append((f"{model.title} {model.arch}", curves))
                self.results[model.name]["curves_from"] = source
            png = plot.plot_losses(panels, self.tensorboard / "loss_curves.png", self.uniform_bits)
        self.results["loss_curves_png"] = str(png)
        return png


def summary(demo: Demo, losses: Dict[str, Dict[str, float]], png: Path, seconds: float) -> None:
    """The closing lines: the loss table, the filled mask, the generated text and where things are."""
    print("\n== results ==")
    print(f"validation loss of the best checkpoints, bits per token (uniform guess: {demo.uniform_bits:.2f}); "
          "the forms compute the same function, so each row should agree to round-off:")
    print(f"  {'model':28} " + " ".join(f"{f:>10}" for f in evaluate.FORMS))
    for model in (MLM, LM):
        row = losses[model.name]
        print(f"  {model.title + ' ' + model.arch:28} " + " ".join(f"{row[f]:10.4f}" for f in evaluate.FORMS))
    best = demo.results["fill_mask"]["top"][0] if demo.results["fill_mask"]["top"] else None
    if best:
        print(f"fill-mask: {best['filled']}  (p={best['prob']:.3f})")
    print(f"generated: {demo.results['generate']['sampled']}")
    print(f"loss curves: {shown([str(png)])}   (live view: tensorboard --logdir {shown([str(demo.tensorboard)])})")
    took = f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"  # a run that reused everything
    print(f"everything in {shown([str(demo.work.root)])}; demo took {took}")


def main(argv: Optional[List[str]] = None) -> None:
    """Run the demo; exit status 1 with one ``error:`` line on a bad option or a failed step, 130 on Ctrl-C."""
    args = build_parser().parse_args(argv)
    start = time.time()
    try:
        try:  # bad options, folders or files: one line naming the option
            check_args(args)
            if args.fresh and (args.workdir / MARKER).exists():
                print(f"--fresh: removing {args.workdir}")
                remove_tree(args.workdir)
            demo = Demo(args)
            demo.work.prepare()
            print(f"LION demo in {shown([str(demo.work.root)])} (python -m lion_fairseq.demo --help for options)")
            files = demo.corpus()
        except ValueError as e:
            raise DemoError(str(e)) from None
        except OSError as e:  # a folder that cannot be written, most often the --workdir
            raise DemoError(f"{e.filename or args.workdir}: {e.strerror or e} (pass a --workdir you can write to)") \
                from None
        data_key = demo.preprocess(files)
        for n, model in ((3, MLM), (4, LM)):
            demo.train(n, model, data_key)
        step(5, "validation loss of each checkpoint in each --lion-form (fairseq-validate / fairseq-eval-lm "
                "with --model-overrides)")
        losses = {m.name: demo.evaluate(m) for m in (MLM, LM)}
        demo.use()
        png = demo.plot()
        seconds = time.time() - start
        demo.results["seconds"] = round(seconds, 1)
        (demo.work.root / "results.json").write_text(json.dumps(demo.results, indent=2, default=str))
        summary(demo, losses, png, seconds)
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to continue (finished steps are reused)", file=sys.stderr)
        sys.exit(130)

if __name__ == "__main__":
    main()
