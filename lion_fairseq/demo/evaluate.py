"""Validation loss of a trained checkpoint in each ``--lion-form``, through fairseq's own evaluators:
``fairseq-validate`` for the masked LM, ``fairseq-eval-lm`` for the causal LM, the form switched with
``--model-overrides`` (the checkpoint was trained in the chunk form)."""
import re
from pathlib import Path
from typing import List

from lion_fairseq.demo.commands import console
from lion_fairseq.demo.train import TOKENS_PER_SAMPLE, Model, json_record

FORMS = ("parallel", "chunk", "recurrent")


def eval_command(model: Model, data: Path, user_dir: str, checkpoint: Path, form: str,
                 batch_size: int) -> List[str]:
    """The evaluator's command line for ``model``'s checkpoint in ``form`` on the valid split."""
    overrides = ["--model-overrides", str({"lion_form": form})]
    if model.name == "mlm":
        return console("fairseq-validate") + [
            str(data), "--user-dir", user_dir, "--path", str(checkpoint), "--task", model.task,
            "--tokens-per-sample", str(TOKENS_PER_SAMPLE), "--sample-break-mode", "none",
            # every block counts (fairseq's default multiple of 8 drops a last, smaller batch)
            "--valid-subset", "valid", "--batch-size", str(batch_size), "--required-batch-size-multiple", "1",
            "--num-workers", "0",
            "--log-format", "json", *overrides]
    return console("fairseq-eval-lm") + [
        str(data), "--user-dir", user_dir, "--path", str(checkpoint), "--gen-subset", "valid",
        "--tokens-per-sample", str(TOKENS_PER_SAMPLE), "--batch-size", str(batch_size), "--num-workers", "0",
        *overrides]


def parse_loss(model: Model, output: str) -> float:
    """The validation loss (base 2) the evaluator printed; ``ValueError`` if it printed none."""
    if model.name == "mlm":
        for line in reversed(output.splitlines()):
            rec = json_record(line, "valid")  # fairseq-validate --log-format json
            if rec is not None and "valid_loss" in rec:
                return float(rec["valid_loss"])
    else:
        m = re.search(r"Loss \(base 2\): ([0-9.]+)", output)
        if m:
            return float(m.group(1))
    raise ValueError(f"no validation loss found in the output of the {model.title} evaluation")
