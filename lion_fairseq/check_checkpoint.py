"""``python -m lion_fairseq.check_checkpoint CHECKPOINT...``: is each checkpoint readable and its bytes intact
(their CRCs), which model and arch is it, and what to pass to fairseq to use it (``--user-dir``). Exit status 1
if one cannot be read. Reads the file alone: no model is built."""
import argparse
import os
import sys
from typing import Any, List, Optional

from .clear_errors import (PACKAGE_DIR, CheckpointError, describe_weights, intact_checkpoints, load_checkpoint_file,
                           trained_as_options)


def explain(path: str) -> str:
    """One paragraph on a checkpoint: readable or not, which model/arch, and what command-line to use."""
    if os.path.isdir(path):
        inside = intact_checkpoints(path, most=1)
        return (f"{path}: a folder; pass a checkpoint file" + (f", e.g. its newest intact one, {inside[0]}" if inside
                                                                else " (it holds no intact *.pt)"))
    if not os.path.isfile(path):
        return f"{path}: no such file"
    try:
        state = load_checkpoint_file(path)
    except CheckpointError as e:  # truncated, failing its CRCs, or intact with an object torch refuses: it says which
        return str(e)
    cfg = state.get("cfg") if hasattr(state.get("cfg"), "get") else {}
    # a dataclass config's sections are dicts; a legacy model's (RoBERTa's) is an argparse.Namespace, inside
    # cfg or as the checkpoint's ``args``
    args = state.get("args")
    name = _field(cfg.get("model"), "_name") or _field(cfg.get("model"), "arch") or _field(args, "arch")
    task = _field(cfg.get("task"), "_name") or _field(args, "task")
    updates = (state.get("optimizer_history") or [{}])[-1].get("num_updates")
    weights = describe_weights(state.get("model", {}), lion=str(name).startswith("lion"))
    where = f"{path}: model/arch {name!r}, task {task!r}, {updates} updates, {weights}."
    if name and str(name).startswith("lion"):
        trained = trained_as_options(cfg.get("model") or (vars(args) if args is not None else None))
        return (where + (f" It was trained as {trained}." if trained else "")
                + f" It was trained with this plugin: every fairseq command that reads it needs "
                f"--user-dir {PACKAGE_DIR} (fairseq-hydra-train: common.user_dir={PACKAGE_DIR}; in Python: "
                "`import lion_fairseq` before loading). Without it fairseq fails with KeyError: \"'_name'\".")
    student = starting_arch(name)
    if student:
        from .models.convert import unrepresentable

        refused = unrepresentable(state.get("model", {}))
        if refused:
            return where + f" A softmax model that LION cannot start from: {refused}."
        others = ", ".join(student.replace("lion_s", v) for v in ("lion_lit", "lion_d"))
        return (where + f" A softmax model that LION starts from: python -m lion_fairseq.convert {path} <out.pt> "
                f"--arch {student} (or {others}) takes its sizes from it and prints the fairseq-train command that "
                "trains on from there.")
    return where


# a softmax model's arch (by its start) -> the LION arch that starts from it (lion_fairseq.convert)
STARTS_FROM = (("roberta", "lion_s"), ("transformer_lm", "lion_s_lm"), ("transformer", "lion_s_transformer"))


def starting_arch(name: Any) -> Optional[str]:
    """The LION arch that starts from a softmax model of arch ``name``; None for other models."""
    return next((arch for prefix, arch in STARTS_FROM if str(name).startswith(prefix)), None)

# a teacher's settings that convert carries over and that are no model structure: each task takes its own
NOT_STRUCTURE = ("max_positions", "tokens_per_sample", "max_source_positions", "max_target_positions",
                 "source_lang", "target_lang")


def softmax_start_options(state: dict) -> Optional[str]:
    """For a softmax checkpoint that LION starts from: LION-S's arch of its kind with the teacher's sizes and
    layer structure, as ``convert`` takes them (heads and activation included, which its weights do not
    show); None for other checkpoints."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    from .convert import TARGETS, teacher_config, teacher_flags, trained_model
    from .models.convert import unrepresentable

    config = teacher_config(state)
    name = trained_model(config)[0]
    student = starting_arch(name)
    if student is None or unrepresentable(state.get("model", {})):
        return None
    structure = {key: value for key, value in config.items() if key not in NOT_STRUCTURE}
    return " ".join(["--arch", student, *teacher_flags(structure, TARGETS[ARCH_MODEL_NAME_REGISTRY[student]], [])])


def _field(section, key: str):
    """``section[key]`` of a config section, dict or ``argparse.Namespace`` (None for a missing one)."""
    if section is None:
        return None
    return section.get(key) if hasattr(section, "get") else getattr(section, key, None)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lion_fairseq.check_checkpoint",
                                     description="Explain a fairseq checkpoint: readable? which model? what to pass?")
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--options", action="store_true",
                        help="print only the options a LION checkpoint was trained as (--arch, its sizes, layer "
                             "structure and LION options), or, for a softmax RoBERTa, transformer_lm or transformer, "
                             "LION-S's arch of its kind with its sizes and structure; one line each; an empty line "
                             "for another checkpoint (for scripts)")
    parser.add_argument("--max-positions", action="store_true",
                        help="print only the sequence length an encoder checkpoint was trained at (its "
                             "--max-positions), one line each (after --options' line, with both); an empty line "
                             "where it has none (for scripts)")
    args = parser.parse_args(argv)
    if args.options or args.max_positions:
        for path in args.checkpoints:
            try:
                state = load_checkpoint_file(path)
            except (CheckpointError, OSError) as e:  # said once, as a line, for the script to stop on (a folder too)
                print(f"error: {e}", file=sys.stderr)
                return 1
            model_cfg = (state.get("cfg") or {}).get("model")
            if args.options:
                print(trained_as_options(model_cfg) or softmax_start_options(state) or "")
            if args.max_positions:  # with --options, on the line after it
                print(_field(model_cfg, "max_positions") or _field(state.get("args"), "max_positions") or "")
        return 0
    bad = 0
    for path in args.checkpoints:
        text = explain(path)
        bad += text.startswith(("cannot read", "cannot load")) or text.endswith("no such file") or os.path.isdir(path)
        print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
