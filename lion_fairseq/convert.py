"""``python -m lion_fairseq.convert IN OUT --arch ARCH [options]``: a softmax fairseq checkpoint (RoBERTa,
transformer_lm or transformer) written as a LION model's, loadable by the hub, --restore-file and
--finetune-from-model.

The arch says which LION model, and so which teacher:

- RoBERTa (e.g. ``roberta.base/model.pt``) with ``--arch lion_s`` (``lion_d``, ``lion_lit_large`` ...);
- ``transformer_lm`` with ``--arch lion_s_lm`` (``lion_lit_lm``, ``lion_d_lm_tiny`` ...);
- ``transformer`` (translation) with ``--arch lion_s_transformer`` (``_iwslt_de_en``, ``_tiny`` ...).

``models/convert.py`` says what is copied, dropped and added. The file has a dataclass config, so it
reloads under torch's ``weights_only``.

The teacher's sizes and the structure its weights do not show (heads, activation, pre- or post-norm,
positions, tied embeddings, languages) are taken from its checkpoint unless given; ``--data`` is the folder
of the teacher's dictionaries (default: the checkpoint's own folder, as in fairseq's released tarballs).
Any other fairseq option of the arch may follow (``--lion-*``, ...)."""
import argparse
import dataclasses
import logging
import os
import re
import shlex
import string
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from .clear_errors import LION_MODELS, CheckpointError, PACKAGE_DIR, load_checkpoint_file, safely_loaded


@dataclass(frozen=True)
class Target:
    """A LION model kind as a conversion builds it, and what of its teacher's config it takes."""
    teacher: str                            # the fairseq model it starts from
    task: Tuple[str, ...]                   # task and criterion options to build it
    criterion: str                          # that criterion's class name, as fairseq records it
    hub: str                                # the class whose from_pretrained loads the result
    dictionaries: Tuple[str, ...]           # the data folder's files, formatted with the teacher's config
    values: Dict[str, Tuple[str, ...]]      # teacher config key -> the options that take its value
    switches: Dict[str, Tuple[str, ...]]    # teacher config key -> (option when true[, option when false])


def _sizes(*stacks: str) -> Dict[str, Tuple[str, ...]]:
    return {f"{s}_{k}": (f"--{s}-{k.replace('_', '-')}",) for s in stacks
            for k in ("layers", "embed_dim", "ffn_embed_dim", "attention_heads")}


TARGETS = {
    "lion_roberta": Target(
        teacher="roberta", task=("--task", "masked_lm", "--criterion", "masked_lm", "--load-checkpoint-heads"),
        criterion="MaskedLmLoss", hub="LionRobertaModel", dictionaries=("dict.txt",),
        values=dict(_sizes("encoder"), activation_fn=("--activation-fn",),
                    pooler_activation_fn=("--pooler-activation-fn",),
                    max_positions=("--max-positions", "--tokens-per-sample")),
        switches=dict(encoder_normalize_before=("--encoder-normalize-before",),
                      layernorm_embedding=("--layernorm-embedding", "--no-layernorm-embedding"),
                      untie_weights_roberta=("--untie-weights-roberta",))),
    "lion_lm": Target(
        teacher="transformer_lm", task=("--task", "language_modeling", "--criterion", "cross_entropy"),
        criterion="CrossEntropyCriterion", hub="LionLanguageModel", dictionaries=("dict.txt",),
        values=dict(_sizes("decoder"), activation_fn=("--activation-fn",), tokens_per_sample=("--tokens-per-sample",),
                    max_target_positions=("--max-target-positions",)),
        switches=dict(decoder_normalize_before=("--decoder-normalize-before", "--no-decoder-normalize-before"),
                      no_decoder_final_norm=("--no-decoder-final-norm",),
                      share_decoder_input_output_embed=("--share-decoder-input-output-embed",),
                      no_scale_embedding=("--no-scale-embedding",),
                      layernorm_embedding=("--layernorm-embedding",))),
    "lion_transformer": Target(
        teacher="transformer", task=("--task", "translation", "--criterion", "cross_entropy"),
        criterion="CrossEntropyCriterion", hub="LionTransformerModel",
        dictionaries=("dict.{source_lang}.txt", "dict.{target_lang}.txt"),
        values=dict(_sizes("encoder", "decoder"), activation_fn=("--activation-fn",), source_lang=("--source-lang",),
                    target_lang=("--target-lang",), max_source_positions=("--max-source-positions",),
                    max_target_positions=("--max-target-positions",)),
        switches={k: ("--" + k.replace("_", "-"),) for k in (
            "encoder_normalize_before", "decoder_normalize_before", "encoder_learned_pos", "decoder_learned_pos",
            "no_token_positional_embeddings", "share_decoder_input_output_embed", "share_all_embeddings",
            "no_scale_embedding", "layernorm_embedding", "no_decoder_final_norm")}),
}


def teacher_config(state: Dict) -> Dict[str, Any]:
    """The options a checkpoint was trained with, flat: legacy ``args``, or the dataclass ``cfg``'s task
    then model (the model's win)."""
    if state.get("args") is not None:
        return dict(vars(state["args"]))
    return {**_cfg_section(state, "task"), **_cfg_section(state, "model")}


def _cfg_section(state: Dict, part: str) -> Dict[str, Any]:
    """One part of a checkpoint's dataclass ``cfg`` (``task``, ``model``) as a dict; empty where absent."""
    section = (state.get("cfg") or {}).get(part) or {}
    # an argparse.Namespace: legacy models' config, also inside cfg
    return dict(section) if hasattr(section, "keys") else vars(section)


def teacher_bpe(state: Dict) -> Optional[Dict[str, Any]]:
    """The BPE section of the teacher's config (``roberta.base``'s legacy args name gpt2), or None: what the
    hub encodes text with, so the converted file keeps it."""
    import dataclasses as dc

    from fairseq.registry import REGISTRIES

    if state.get("args") is None:
        bpe = (state.get("cfg") or {}).get("bpe")
        return dict(bpe) if bpe and bpe.get("_name") else None
    args = state["args"]
    name = getattr(args, "bpe", None)
    if not name:
        return None
    fields = REGISTRIES["bpe"]["dataclass_registry"].get(name)
    options = {f.name: getattr(args, f.name) for f in dc.fields(fields) if f.name != "_name" and hasattr(args, f.name)
               } if fields else {}
    return {"_name": name, **options}


def trained_model(config: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """(arch, fairseq model name) that a checkpoint's ``teacher_config`` was trained as; None where unknown."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    arch = config.get("arch") or config.get("_name")
    return arch, ARCH_MODEL_NAME_REGISTRY.get(arch)


def passed(option: str, extra: List[str]) -> bool:
    """Whether the user's options ``extra`` give ``option``, as ``--x v`` or ``--x=v``."""
    return any(e == option or e.startswith(option + "=") for e in extra)


def teacher_flags(config: Dict[str, Any], target: Target, extra: List[str]) -> List[str]:
    """The command-line options that give the LION model its teacher's sizes and structure, leaving out
    any the user passed (in either spelling of a switch)."""
    flags: List[str] = []
    for key, options in target.values.items():
        for option in options:
            if config.get(key) is not None and not passed(option, extra):
                flags += [option, str(config[key])]
    for key, options in target.switches.items():
        value = config.get(key)
        if value is None or any(passed(o, extra) for o in options):
            continue
        if value:
            flags.append(options[0])
        elif len(options) > 1:
            flags.append(options[1])
    return flags


# the archs of each LION model kind, as a user picks one
ARCHS = {model: f"{LION_MODELS[model][2]} ({what})" for model, what in (
    ("lion_roberta", "masked LM, from RoBERTa"), ("lion_lm", "causal LM, from transformer_lm"),
    ("lion_transformer", "translation, from transformer"))}


def target_of(arch: str, config: Dict[str, Any]) -> Target:
    """The LION model kind of ``arch``; refuses an arch of none, or one that does not start from the teacher."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    kind = ARCH_MODEL_NAME_REGISTRY.get(arch)
    if kind not in TARGETS:
        raise ValueError(f"--arch {arch} is not a LION arch that a softmax checkpoint converts into: pick one of "
                         f"{', '.join(ARCHS.values())}")
    target = TARGETS[kind]
    trained_arch, teacher = trained_model(config)
    if teacher in TARGETS:  # a LION checkpoint already: fairseq-train starts from it as it is
        other = (f"; for --arch {arch}, convert the softmax checkpoint it started from" if arch != trained_arch
                 else "")  # another variant's or size's weights, which fairseq-train would refuse
        raise ValueError(f"the checkpoint is already a LION model ({teacher}, --arch {trained_arch}): nothing to "
                         f"convert. Start from it with fairseq-train --arch {trained_arch} --finetune-from-model "
                         f"(or --restore-file with the --reset-* options), or load it with the hub{other}")
    if teacher is not None and teacher != target.teacher:
        starts = {t.teacher: name for name, t in TARGETS.items()}
        hint = (f"a {starts[teacher]} arch" if teacher in starts
                else "a checkpoint of RoBERTa, transformer_lm or transformer")
        raise ValueError(f"the checkpoint is a fairseq {teacher}, and --arch {arch} starts from a {target.teacher}: "
                         f"pick {hint}")
    return target


def teacher_task(state: Dict) -> Tuple[Optional[str], Dict[str, Any]]:
    """The task a checkpoint was trained under and its options: from legacy ``args`` (flat, all options), or
    the dataclass ``cfg``'s task section (a dict, or an ``argparse.Namespace`` in older configs)."""
    if state.get("args") is not None:
        options = vars(state["args"])
        return options.get("task"), options
    options = _cfg_section(state, "task")
    return options.get("_name"), options


def classifier_target(target: Target, state: Dict, config: Dict[str, Any]) -> Target:
    """``target``, or for a RoBERTa fine-tuned with ``--task sentence_prediction`` (GLUE) the same model built
    under that task: its data folder holds ``input0/`` (and ``label/``) dictionaries, and its classification
    heads come with it."""
    if target.teacher != "roberta" or teacher_task(state)[0] != "sentence_prediction":
        return target
    regression = bool(config.get("regression_target"))
    return dataclasses.replace(
        target, task=("--task", "sentence_prediction", "--criterion", "sentence_prediction", "--num-classes",
                      str(config.get("num_classes")), *(("--regression-target",) if regression else ())),
        criterion="SentencePredictionCriterion", values=dict(target.values, max_positions=("--max-positions",)),
        dictionaries=("input0/dict.txt",) + (() if regression else ("label/dict.txt",)))


def teacher_task_settings(state: Dict, target: Target, extra: List[str]) -> Dict[str, Any]:
    """How the teacher read its data (``--init-token``, ``--separator-token``, ``--shorten-method``,
    ``--sample-break-mode``, ...), where it was trained under the task the LION model is built with: the
    evaluation tools and the hubs read them from the converted file. Leaves out the data path, the sizes
    ``teacher_flags`` gives, what the task takes from other groups (``seed``), what ``extra`` sets, and the
    evaluation during training (``--eval-bleu``: every load would build its detokenizer and generator)."""
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    name = target.task[1]
    trained_as, task = teacher_task(state)
    if trained_as != name or name not in TASK_DATACLASS_REGISTRY:
        return {}
    sized = {option for options in target.values.values() for option in options}
    settings = {}
    for field in dataclasses.fields(TASK_DATACLASS_REGISTRY[name]):
        option = "--" + field.name.replace("_", "-")
        interpolated = isinstance(field.default, str) and field.default.startswith("${")
        given = passed(option, extra)
        left_out = field.name in ("_name", "data") or field.name.startswith("eval_")
        if field.name in task and not (left_out or interpolated or given or option in sized):
            settings[field.name] = task[field.name]
    return settings


LANGUAGE_SHORT = {"source_lang": ("-s",), "target_lang": ("-t",)}  # fairseq's short spellings


def check_dictionaries(data: str, target: Target, config: Dict[str, Any], extra: List[str]) -> None:
    """Each dictionary the model is built with, named from the teacher's config, must be in ``data``. Where the
    config lacks a name (a teacher trained without -s/-t) and the options do not give it, fairseq infers the
    languages from the binarised data's file names, and without them they are asked for."""
    from fairseq.data.data_utils import infer_language_pair

    for pattern in target.dictionaries:
        missing = [field for _, field, _, _ in string.Formatter().parse(pattern) if field and config.get(field) is None]
        if missing:
            given = any(passed(option, extra) for name in missing
                        for option in target.values.get(name, ()) + LANGUAGE_SHORT.get(name, ()))
            if not given and infer_language_pair(data) == (None, None):
                found = sorted(f for f in os.listdir(data) if re.fullmatch(r"dict\..+\.txt", f))
                raise ValueError(f"the teacher's config records no languages (it was trained without -s/-t), and "
                                 f"{data} has no binarised data to infer them from: pass --source-lang and "
                                 f"--target-lang (dictionaries there: {', '.join(found) or 'none'}), or --data "
                                 "<the teacher's data-bin>")
            continue
        name = pattern.format(**config)
        if not os.path.isfile(os.path.join(data, name)):
            raise FileNotFoundError(f"no {name} in {data}: pass --data <the teacher's data folder, which holds {name}>")


def converted_before(path: str) -> bool:
    """Whether ``path`` is a checkpoint that a conversion wrote, which running it again may replace."""
    state = safely_loaded(path)
    return isinstance(state, dict) and "converted_from" in (state.get("extra_state") or {})


def convert(checkpoint: str, out: str, arch: str, data: Optional[str] = None,
            extra: Optional[List[str]] = None) -> Tuple[torch.nn.Module, List[str]]:
    """Writes the converted checkpoint to ``out``; returns the LION model (in eval mode) and the options
    that build it again under ``--arch arch``: the teacher's sizes and structure where the arch's own
    differ, and ``extra``."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    extra = list(extra or [])
    if os.path.exists(out) and os.path.exists(checkpoint) and os.path.samefile(checkpoint, out):
        raise ValueError(f"the output {out} is the softmax checkpoint itself, which writing it would replace: "
                         "pass another path for the LION checkpoint")
    if os.path.isfile(out) and not converted_before(out):
        raise ValueError(f"the output {out} exists and was not written by this command (a trained checkpoint, say), "
                         "and writing it would replace that: pass another path for the LION checkpoint, or remove "
                         "the file first")
    # refused before the conversion runs, not by torch.save after it
    if os.path.isdir(out):
        raise ValueError(f"the output {out} is a folder: pass the LION checkpoint's file path, e.g. "
                         f"{os.path.join(out, 'model.pt')}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise FileNotFoundError(f"the output's folder {os.path.dirname(os.path.abspath(out))} does not exist: "
                                "create it (mkdir -p) or pass a path in a folder that exists")
    state = load_checkpoint_file(checkpoint)
    config = teacher_config(state)
    target = classifier_target(target_of(arch, config), state, config)
    data = data or os.path.dirname(os.path.abspath(checkpoint))
    check_dictionaries(data, target, config, extra)

    def refuse(message: str) -> None:  # argparse would print fairseq-train's whole usage under convert.py's name
        raise ValueError(f"{message} (the options after --arch are fairseq-train's: fairseq-train --user-dir "
                         f"{PACKAGE_DIR} --arch {arch} --help lists them)")

    def parsed(flags: List[str]) -> argparse.Namespace:
        parser = options.get_training_parser()
        parser.error = refuse
        return options.parse_args_and_arch(parser, [
            data, "--user-dir", PACKAGE_DIR, *target.task, "--arch", arch, *flags, *extra])

    ns = parsed(teacher_flags(config, target, extra))
    vars(ns).update(teacher_task_settings(state, target, extra))
    plain = parsed([])
    differing = {key: value for key, value in config.items() if getattr(ns, key, None) != getattr(plain, key, None)}
    with warnings.catch_warnings():  # hydra's deprecation notices about fairseq's own use of it
        warnings.filterwarnings("ignore", message=r"(?s).*hydra", category=UserWarning)  # matched ignoring case
        cfg = convert_namespace_to_omegaconf(ns)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    try:
        model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)  # converts (upgrade_state_dict_named)
    except RuntimeError as e:  # the load's own explanation (clear_errors), refused as the others are
        raise ValueError(str(e)) from e
    saved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if saved.get("bpe") is None:  # no --bpe passed: the hub encodes as the teacher did
        saved["bpe"] = teacher_bpe(state)
    # a new run's data loader state (epoch 1): fairseq starts a file without one at epoch 0, an epoch too many
    torch.save({"cfg": saved, "args": None,
                "model": model.state_dict(), "criterion": None,
                "optimizer_history": [{"criterion_name": target.criterion, "optimizer_name": "none",
                                       "lr_scheduler_state": {}, "num_updates": 0}],
                "task_state": {},
                "extra_state": {"converted_from": os.path.abspath(checkpoint),
                                "train_iterator": {"epoch": 1, "iterations_in_epoch": 0}},
                "last_optimizer_state": None}, out)
    return model.eval(), teacher_flags(differing, target, extra) + extra


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.convert", description=__doc__.split("\n\n")[0],
                                epilog="Other fairseq options of the arch may follow, e.g. --lion-form chunk.")
    p.add_argument("checkpoint", help="the softmax model's checkpoint (RoBERTa, transformer_lm, transformer)")
    p.add_argument("out", help="where to write the LION checkpoint")
    p.add_argument("--arch", required=True, help="the LION arch, e.g. lion_s, lion_d_lm, lion_lit_transformer")
    p.add_argument("--data", help="folder of the teacher's dictionaries (default: the checkpoint's folder)")
    args, extra = p.parse_known_args(argv)
    # what the conversion dropped, added and took from the options is logged (models/convert.py), as under
    # fairseq-train; fairseq's own commands set logging up the same way
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        level=logging.INFO, stream=sys.stderr)
    try:
        model, flags = convert(args.checkpoint, args.out, args.arch, args.data, extra)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"lion_fairseq.convert: {e}", file=sys.stderr)
        return 2
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    hub = TARGETS[ARCH_MODEL_NAME_REGISTRY[args.arch]].hub
    params = sum(p.numel() for p in model.parameters())
    # fairseq-train builds the model from its command line: what the teacher set must be given again
    print(f"wrote {args.out}: {args.arch}, {params / 1e6:.1f}M parameters. Start from it with fairseq-train "
          f"--user-dir {PACKAGE_DIR} --arch {' '.join([args.arch, *map(shlex.quote, flags)])} "
          f"--finetune-from-model {args.out} ..., or load it with "
          f"{hub}.from_pretrained({os.path.dirname(os.path.abspath(args.out))!r}, "
          f"{os.path.basename(args.out)!r}, <data>)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
