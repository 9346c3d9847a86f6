"""Starting a LION language model from a trained ``transformer_lm``, measured at CPU scale:

    python -m lion_fairseq.benchmark.uptrain_lm          # 3 seeds: about 15 minutes on 2 cores

``benchmark.uptrain``'s masked-LM measurement for a causal LM. Per seed, on the demo's corpus at
``benchmark.quality``'s LM settings (2 layers x 128, 2 heads, FFN 512, 16 x 128 tokens a batch, Adam at lr
1e-3, inverse_sqrt, dropout 0.1), all through ``fairseq-train`` as a user runs it:

- **teacher**: plain ``--arch transformer_lm`` (post-norm, relu, sinusoidal positions) trained N updates;
- **converted, step 0**: its weights in ``lion_{lit,d,s}_lm_tiny`` (``python -m lion_fairseq.convert``);
- **uptrained**: each of those trained U = N/10 updates (``--finetune-from-model`` the teacher, with the
  teacher's post-norm layers and relu);
- **scratch**: ``lion_s_lm_tiny`` from its own initialisation, U updates and N updates.

On this 90k-token corpus a softmax LM overfits within a few hundred updates (``benchmark.quality``), so
every model is its best valid checkpoint (fairseq's ``checkpoint_best.pt``, saved each epoch of about 40
updates and at the end), and every loss is ``fairseq-eval-lm``'s on the valid split, in bits, at the
training length. Writes ``uptrain_lm.md``, ``uptrain_lm.json`` and ``uptrain_lm.png`` into ``--out``."""
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from ..demo.commands import python_module, run
from .quality import TINY_LM, TOKENS, eval_lm_command, eval_loss, prepare_text
from .uptrain import arguments, plot, result_row, slug, table, train

TEACHER = ["--arch", "transformer_lm", *TINY_LM]
# what the teacher's weights cannot show, for the LION LMs that start from it (python -m lion_fairseq.convert
# reads it from the teacher's config): plain transformer_lm is post-norm with relu, and its sinusoidal
# positions have no weights, so LION-LIT goes without (D and S have none anyway)
STRUCTURE = ["--no-decoder-normalize-before", "--activation-fn", "relu", "--lion-positions", "none"]


def valid_loss(root: Path, data: Path, checkpoint: Path, tag: str) -> float:
    """The checkpoint's loss (bits) on the valid split through ``fairseq-eval-lm`` at the training length:
    the split of the learning curves and of ``benchmark.uptrain``'s losses."""
    out, _ = run(eval_lm_command(data, checkpoint, TOKENS, "valid"), root / "logs" / f"{tag}_eval.log",
                 what=f"scoring {tag}")
    return eval_loss(out)


def one_seed(root: Path, data: Path, seed: int, N: int) -> List[Dict]:
    U = max(2, N // 10)
    every = max(1, U // 5)
    rows: List[Dict] = []

    def row(name: str, checkpoint: Path, updates: int, run_: Optional[Dict] = None) -> None:
        loss = valid_loss(root, data, checkpoint, f"{slug(name)}_{seed}")
        rows.append(result_row(name, seed, checkpoint, updates, loss, run_))

    teacher = train(root, data, f"teacher_{seed}", TEACHER, N, seed, max(1, N // 10), what="lm")
    row("teacher", teacher["checkpoint"], N, teacher)
    for v in ("lit", "d", "s"):
        converted = root / "checkpoints" / f"{v}_converted_{seed}.pt"
        run(python_module("lion_fairseq.convert") + [str(teacher["checkpoint"]), str(converted), "--arch",
                                                      f"lion_{v}_lm_tiny", "--data", str(data), "--lion-positions",
                                                      "none"],
            root / "logs" / f"{v}_convert_{seed}.log", what=f"converting to lion_{v}_lm")
        row(f"lion_{v} converted, step 0", converted, 0)
        up = train(root, data, f"{v}_uptrained_{seed}", ["--arch", f"lion_{v}_lm_tiny", *STRUCTURE,
                   "--finetune-from-model", str(teacher["checkpoint"])], U, seed, every, warmup=max(1, U // 10),
                   what="lm")
        row(f"lion_{v} uptrained", up["checkpoint"], U, up)
    for n, name in ((U, "lion_s scratch, U updates"), (N, "lion_s scratch, N updates")):
        scratch = train(root, data, f"s_scratch_{n}_{seed}", ["--arch", "lion_s_lm_tiny"], n, seed,
                        every if n == U else max(1, N // 10), what="lm")
        row(name, scratch["checkpoint"], n, scratch)
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    args, out = arguments("uptrain_lm", __doc__, 600, argv)
    data = prepare_text(out)
    with ThreadPoolExecutor(2) as pool:
        rows = [r for rs in pool.map(lambda s: one_seed(out / f"seed{s}", data, s, args.updates), args.seeds)
                for r in rs]
    (out / "uptrain_lm.json").write_text(json.dumps(rows, indent=1, default=str))
    U = max(2, args.updates // 10)
    text = [f"### Starting LION from a transformer_lm teacher: N = {args.updates} teacher updates, U = {U}; "
            f"seeds {args.seeds}; fairseq-eval-lm on the valid split", "", table(rows)]
    if plot(rows, out / "uptrain_lm.png"):
        text += ["", f"Learning curves: {out / 'uptrain_lm.png'}"]
    text += ["", f"Commands (seed {args.seeds[0]}):", "", "```"]
    text += [r["command"] for r in rows if r["seed"] == args.seeds[0] and r["command"]] + ["```"]
    (out / "uptrain_lm.md").write_text("\n".join(text) + "\n")
    print("\n" + "\n".join(text), flush=True)


if __name__ == "__main__":
    main()
