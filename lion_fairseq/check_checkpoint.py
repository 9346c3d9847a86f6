"""``python -m lion_fairseq.check_checkpoint CHECKPOINT...``: is each checkpoint readable, which model and
arch is it, and what to pass to fairseq to use it (``--user-dir``). Exit status 1 if one cannot be read.
Works without importing fairseq's models."""
import argparse
import os
import sys
from typing import List, Optional

from .clear_errors import (PACKAGE_DIR, describe_weights, load_checkpoint_file, refused_object_message,
                           trained_as_options, unreadable_checkpoint_message)


def explain(path: str) -> str:
    """One paragraph on a checkpoint: readable or not, which model/arch, and what command-line to use."""
    if not os.path.isfile(path):
        return f"{path}: no such file"
    try:
        state = load_checkpoint_file(path)
    except Exception as e:  # noqa: BLE001 - any failure to read is the diagnosis
        if "Weights only load failed" in str(e):
            return refused_object_message(path, e)
        return unreadable_checkpoint_message(path, e)
    cfg = state.get("cfg") or {}
    model_cfg = cfg.get("model") if hasattr(cfg, "get") else None
    name = None
    if model_cfg is not None:
        name = model_cfg.get("_name") if hasattr(model_cfg, "get") else None
    if name is None and state.get("args") is not None:
        name = getattr(state["args"], "arch", None)
    task = None
    if hasattr(cfg, "get") and cfg.get("task") is not None:
        task = cfg["task"].get("_name")
    updates = (state.get("optimizer_history") or [{}])[-1].get("num_updates")
    where = f"{path}: model/arch {name!r}, task {task!r}, {updates} updates, {describe_weights(state.get('model', {}))}."
    if name and str(name).startswith("lion"):
        return (where + f" It was trained with this plugin: every fairseq command that reads it needs "
                f"--user-dir {PACKAGE_DIR} (fairseq-hydra-train: common.user_dir={PACKAGE_DIR}; in Python: "
                "`import lion_fairseq` before loading). Without it fairseq fails with KeyError: \"'_name'\".")
    return where


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lion_fairseq.check_checkpoint",
                                     description="Explain a fairseq checkpoint: readable? which model? what to pass?")
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--options", action="store_true",
                        help="print only the options a LION checkpoint was trained as (--arch, its sizes, layer "
                             "structure and LION options), "
                             "one line each; an empty line for another checkpoint (for scripts)")
    args = parser.parse_args(argv)
    if args.options:
        for path in args.checkpoints:
            print(trained_as_options((load_checkpoint_file(path).get("cfg") or {}).get("model")) or "")
        return 0
    bad = 0
    for path in args.checkpoints:
        text = explain(path)
        bad += text.startswith(("cannot read", "cannot load")) or text.endswith("no such file")
        print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
