"""Clear messages for faults users meet with fairseq: a truncated or corrupt checkpoint, a checkpoint of
another architecture, a checkpoint read without ``--user-dir``, an empty data split, ``--ddp-backend
c10d`` on CPU, a misspelled ``--model-overrides`` key, ``fairseq-eval-lm`` on samples longer than the
model's positions or on a model of another kind, a run resumed as another model, ``fairseq-train --bf16``,
``--print-alignment`` on linear cross-attention, a LION arch with another model's ``--task``, a ``--lion-*``
option where no model takes it (``fairseq-eval-lm --lion-form``: ``--model-overrides``), a misspelled model
name (``model._name`` under fairseq-hydra-train), ``--num-classes`` below the labels of sentence_prediction's
data, samples of an evaluated split that fairseq's batching leaves out, a split of which it skips every
sample.
Each says what is wrong and what to pass; none changes what a working run does, except that a LION run
resumed at or past ``--max-update`` ends at once (fairseq trained an update more and saved over its
checkpoints).

``install()`` (called when the package is imported, i.e. with ``--user-dir lion_fairseq``) wraps fifteen
fairseq functions so that their failures carry such a message (the original error stays chained) or that they
do not fail:
``checkpoint_utils.load_checkpoint_to_cpu``, ``data_utils.load_indexed_dataset``,
``models.DistributedFairseqModel``, ``Trainer.__init__`` (``--bf16`` without a TPU, ``--fp16`` without CUDA),
``Trainer.load_checkpoint`` (whose own 'please ensure that the architectures match' would otherwise be the
last line a user reads, and which starts from random weights where a ``--restore-file`` given with
``--reset-*`` options does not exist, fine-tunes from a folder or over its own --save-dir, or resumes a run as
another model),
``LanguageModelingTask.eval_lm_dataloader`` (which skips over-long samples with one log line),
``LanguageModelingTask.load_dataset`` (blocks of no token: ``--context-window`` not below
``--tokens-per-sample`` in fairseq-eval-lm),
``LanguageModelingTask.build_model`` (a checkpoint of another kind given to fairseq-eval-lm),
``distributed.utils.broadcast_object`` (which resumes a multi-process run through a ``torch.load`` that
``weights_only`` refuses), ``FairseqTask.build_generator`` (``--print-alignment`` where no attention
weights are formed; ``--score-reference`` of an ensemble with linear cross-attention, which failed averaging
its attention), ``FairseqTask.add_args`` (a ``--lion-*`` option no model on the command line
takes), ``models.build_model`` (a model name fairseq does not know; under fairseq-hydra-train, options named
as hydra spells them), ``SentencePredictionTask.build_model`` (``--num-classes`` against the labels),
``FairseqTask.get_batch_iterator`` (the samples ``--required-batch-size-multiple`` drops from a split it
evaluates, fairseq #5036) and ``FairseqTask.build_bpe`` (fairseq-interactive on sentencepiece data without
``--bpe``, which read every input word as ``<unk>``).
Without ``--user-dir`` nothing of this package runs, so fairseq's own ``KeyError: "'_name'"`` cannot be
intercepted: ``python -m lion_fairseq.check_checkpoint CHECKPOINT`` explains any checkpoint (missing,
truncated, which model and arch, what to pass).

Checkpoints are read with torch's ``weights_only=True`` default; ``argparse.Namespace`` (the legacy
``args`` of older fairseq checkpoints) and numpy scalars (a best score) are allowed for the duration of the
call only, never globally; likewise where fairseq's ``broadcast_object`` sends the checkpoint rank 0 read to
the other ranks (``_wrap_broadcast_object``).
torch before 2.5 has no such allowance (``torch.serialization.safe_globals``), and before 2.6 loads with
``weights_only=False`` by default: there checkpoints load as fairseq loads them, with torch's default.
"""
import argparse
import contextlib
import difflib
import errno
import functools
import inspect
import logging
import os
import pickle
import re
import sys
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

logger = logging.getLogger(__name__)

PACKAGE_DIR = str(Path(__file__).resolve().parent)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with what to do about it."""


def corrupt_record(path: str) -> Optional[str]:
    """The first record of a checkpoint's zip whose bytes fail their CRC, or None. torch.load does not check
    them: a checkpoint whose bytes changed on disk or in a copy loads, and trains, without a word."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        return z.testzip()


def intact_checkpoints(path: str, most: int = 3) -> List[str]:
    """Up to ``most`` intact ``*.pt`` files next to ``path`` (or in it, a folder), newest first."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".pt") and
                 os.path.join(folder, n) != os.path.abspath(path)]
    except OSError:
        return []
    paths = [os.path.join(folder, n) for n in names]
    # torch saves a zip, whose directory is written last: a file cut short has none and is no candidate; one
    # whose bytes fail their CRCs is no candidate either (read newest first, until enough are found)
    intact = []
    for p in sorted((p for p in paths if zipfile.is_zipfile(p)), key=os.path.getmtime, reverse=True):
        if len(intact) == most:
            break
        if corrupt_record(p) is None:
            intact.append(p)
    return intact


def unreadable_checkpoint_message(path: str, error: BaseException) -> str:
    """What to tell a user whose checkpoint ``torch.load`` could not read."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    with open(path, "rb") if size else contextlib.nullcontext() as f:
        start = f.read(4) if f else b""
    # torch.save writes a zip (a pickle before torch 1.6): a truncated checkpoint still starts as one, or with
    # the zeros a crash leaves in a file whose blocks were allocated but not written
    if start.strip(b"\x00") and not start.startswith((b"PK", b"\x80")):
        return (f"cannot read {path} ({size} bytes): it is not a checkpoint (torch.save writes a zip file, and this "
                f"file starts with {start!r}): pass a checkpoint file, a checkpoint_best.pt or checkpoint_last.pt "
                "of a run's --save-dir")
    others = intact_checkpoints(path)
    hint = (f" Intact checkpoints next to it, newest first (python -m lion_fairseq.check_checkpoint reads "
            f"one): {', '.join(others)}." if others else "")
    first = (str(error).split(". ")[0] or "empty file")[:160]
    return (f"cannot read checkpoint {path} ({size} bytes): the file is truncated or corrupt "
            f"({type(error).__name__}: {first}). This happens when a run is "
            "killed while it writes or copies a checkpoint, or when a copy is incomplete. fairseq-train resumes from "
            "<save-dir>/checkpoint_last.pt: copy an intact checkpoint_<epoch>_<update>.pt over it, or pass "
            "--restore-file <an intact checkpoint> (deleting it would start the run afresh, over the checkpoints "
            f"beside it).{hint}")


def refused_object_message(path: str, error: BaseException) -> str:
    """What to tell a user whose intact checkpoint holds an object that torch's ``weights_only`` load refuses."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    what = found.group(1) if found else "an object"
    return (f"cannot load checkpoint {path}: the file is intact, but it holds {what}, which torch's safe "
            "(weights_only) load refuses and this plugin does not allow. If you trust the file, "
            f"torch.serialization.add_safe_globals([{what}]) before loading it allows that class")


def _numpy_values() -> List[Any]:
    """What pickles numpy scalars and arrays: fairseq keeps sklearn's and scipy's metrics as the best
    checkpoint's score (``--report-acc-and-f1``, ``--report-pearson-and-spearman``: MRPC, QQP, STS-B), and
    ``--eval-bleu`` its BLEU counts as arrays among the meters every checkpoint saves."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    return [scalar, _reconstruct, np.ndarray, np.dtype,
            *{type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.bool_)}]


def _allowed_in_checkpoints(*more: type) -> contextlib.AbstractContextManager:
    """What fairseq's checkpoints hold besides tensors and containers, allowed in ``weights_only`` loads
    inside the block (torch >= 2.5): ``argparse.Namespace`` (legacy ``args``), numpy scalars and arrays (a
    best score, BLEU counts), and the classes ``more``. On older torch, which has no such allowance and whose
    default load is not ``weights_only``, nothing."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:
        return contextlib.nullcontext()
    return safe_globals([argparse.Namespace, *_numpy_values(), *more])


def _wrap_broadcast_object(original):
    """fairseq's ``broadcast_object``, by which rank 0 sends the checkpoint it read to the other ranks, loads
    what it receives with ``torch.load``: under torch's ``weights_only`` default (torch >= 2.6) a checkpoint's
    state failed there (its config is an omegaconf ``DictConfig``, its tensors stand in as fairseq's
    ``_TensorPlaceholder``), so no multi-process run could resume. The config travels as plain data and is
    made a ``DictConfig`` again on arrival, as ``load_checkpoint_to_cpu`` makes it; the placeholders are
    allowed for the call."""
    @functools.wraps(original)
    def broadcast_object(obj, src_rank, group, dist_device=None):
        from fairseq.distributed.utils import _TensorPlaceholder
        from omegaconf import DictConfig, OmegaConf

        if isinstance(obj, dict) and isinstance(obj.get("cfg"), DictConfig):
            obj = dict(obj, cfg=OmegaConf.to_container(obj["cfg"]))
        with _allowed_in_checkpoints(_TensorPlaceholder):
            received = original(obj, src_rank, group, dist_device)
        if isinstance(received, dict) and isinstance(received.get("cfg"), dict):
            received["cfg"] = OmegaConf.create(received["cfg"], flags={"allow_objects": True})
        return received
    broadcast_object.__lion_wrapped__ = True
    return broadcast_object


def checkpoint_file_error(path: str, error: BaseException) -> CheckpointError:
    """The error to raise for ``error``, which reading the checkpoint file ``path`` raised: the file is intact
    but holds an object that torch's ``weights_only`` load refuses, or it is truncated or corrupt."""
    if "Unsupported global" in str(error):  # torch names the refused object so; else the file itself is bad
        return CheckpointError(refused_object_message(path, error))
    return CheckpointError(unreadable_checkpoint_message(path, error))


def _of_the_file(error: BaseException) -> bool:
    """Whether an error from fairseq's checkpoint reader is about the file's bytes (a truncated zip, an empty
    file, a bad pickle), not about what fairseq did with what it read."""
    text = str(error)
    return (isinstance(error, (pickle.UnpicklingError, EOFError))
            or (isinstance(error, OSError) and error.errno == errno.EINVAL)  # torch's zip reader, on some cuts
            or any(s in text for s in ("PytorchStreamReader", "zip archive", "central directory", "legacy .tar"))
            or "pickle" in text.lower())


def check_crc(path: str) -> None:
    """Raise ``CheckpointError`` where a record of the checkpoint ``path`` fails its CRC: torch.load reads such
    a file without a word, and fairseq-train would resume from it and save over it. Costs a read of the file
    (0.2 s for 500 MB, measured), which the load then finds in the page cache."""
    bad = corrupt_record(path) if os.path.isfile(path) else None
    if bad is not None:
        raise checkpoint_file_error(path, ValueError(f"its record {bad} fails its CRC check"))


def load_checkpoint_file(path: str) -> Dict[str, Any]:
    """``torch.load`` of a checkpoint as fairseq loads it, allowing what ``_allowed_in_checkpoints`` allows for
    this call only: ``weights_only`` where torch can allow it, torch's own default otherwise (torch < 2.5).
    A file torch cannot read, or whose bytes fail their CRCs, raises ``CheckpointError`` saying why and what
    to do."""
    check_crc(path)
    weights_only = {"weights_only": True} if hasattr(torch.serialization, "safe_globals") else {}
    with _allowed_in_checkpoints():
        try:
            return torch.load(path, map_location="cpu", **weights_only)
        except Exception as e:  # noqa: BLE001 - of an existing file, any failure of torch.load is the file's
            if not os.path.isfile(path):
                raise
            raise checkpoint_file_error(path, e) from e


# what the weights were trained with: an override of one loads without a word (no tensor changes shape) and
# runs another model on them (softmax cross-attention's weights read as linear, say)
FIXED_BY_TRAINING = ("lion_variant", "lion_feature_map", "lion_normalize", "lion_norm_after", "lion_positions",
                     "lion_gate_temperature", "lion_output_gate", "lion_short_conv", "lion_cross_attention",
                     "lion_order", "activation_fn", "no_scale_embedding")


def _same_option(a: Any, b: Any) -> bool:
    """Two values of an option alike: 1 and 1.0, True and 'True' (an override's spelling, a config's type)."""
    return a == b or str(a) == str(b)


def changed_model_message(model_cfg: Any, fixed: Dict[str, Any]) -> Optional[str]:
    """What is wrong with overrides of ``FIXED_BY_TRAINING`` options (``fixed``) whose values differ from
    what a model built from the checkpoint's model config runs with; None where each equals it."""
    from .models.lion_options import built_value

    def shown(value: Any) -> str:  # None: a translation model's fairseq positions
        return "the arch's default" if value is None else repr(value)

    trained = {key: built_value(model_cfg, key) for key in fixed}
    changed = [f"{key}={value!r} (trained with {shown(trained[key])})" for key, value in fixed.items()
               if not _same_option(trained[key], value)]
    if not changed:
        return None
    return (f"--model-overrides (or the hub's keyword arguments) change the model the weights were trained as: "
            f"{', '.join(changed)}. Loaded, it would run another model on them without a word; a trained "
            "checkpoint switches lion_form and lion_chunk_size, and the rest is set by training (or fine-tuning) "
            "with the option")


# the model config of the last checkpoint read, by its path, for the trainer that asked for it
_TRAINED_AS: Dict[str, Any] = {}


def option_text(key: str, value: Any) -> str:
    """A ``FIXED_BY_TRAINING`` option's value as the command line gives it."""
    flag = "--" + key.replace("_", "-")
    if value is None:  # a translation model's unset positions: fairseq's own
        return f"no {flag}"
    if isinstance(value, bool):
        if key in ("lion_normalize", "lion_output_gate"):
            return flag if value else f"--no-{flag[2:]}"
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


# the head counts are not in the weights of LION-LIT or of a softmax model either (LION-D/S's gates show them)
HEADS = ("encoder_attention_heads", "decoder_attention_heads")
# what a softmax teacher's weights do not show and a LION model started from them must share (its norms are
# in the weights: a LayerNorm more or less is refused when they load)
TEACHER_STRUCTURE = ("activation_fn", *HEADS)


def is_lion_config(model_cfg: Any) -> bool:
    """Whether a model config (a DictConfig, a Namespace or a checkpoint's plain dict) is a LION model's:
    its variant set, or, where an arch leaves it unset (fairseq-hydra-train's ``model._name: lion_lm``),
    its name one of LION's models or archs."""
    if model_cfg is None:
        return False
    get = model_cfg.get if isinstance(model_cfg, dict) else lambda key: getattr(model_cfg, key, None)
    if get("lion_variant") is not None:
        return True
    name = get("_name") or get("arch")
    return isinstance(name, str) and bool(_options_of(name))


def _as_built(model_cfg: Any) -> Any:
    """A copy of a LION model config with what its arch function fills where it holds None: under
    fairseq-hydra-train (``model._name: lion_lm``) the model fills its defaults into a copy at build time, and
    the config saved beside the weights keeps None where fairseq-train's ``--arch lion_lm`` saved the value."""
    from types import SimpleNamespace

    from fairseq.models import ARCH_CONFIG_REGISTRY
    from omegaconf import OmegaConf

    items = (OmegaConf.to_container(model_cfg, resolve=False) if OmegaConf.is_config(model_cfg)
             else dict(model_cfg) if isinstance(model_cfg, dict) else dict(vars(model_cfg)))
    copy = SimpleNamespace(**{key: value for key, value in items.items() if isinstance(key, str)})
    fill = ARCH_CONFIG_REGISTRY.get(items.get("_name") or items.get("arch"))
    if fill is not None:
        fill(copy)  # not an argparse.Namespace: no command-line checks
    return copy


def changed_since_training(trained: Any, building: Any) -> List[str]:
    """What the LION model config ``building`` gives otherwise than the checkpoint's ``trained``, as
    'trained -> now': the ``FIXED_BY_TRAINING`` options and head counts of a LION checkpoint, the
    ``TEACHER_STRUCTURE`` of a softmax one."""
    from .models.lion_options import built_value

    if trained is None or not is_lion_config(building):
        return []
    building = _as_built(building)
    trained = _as_built(trained) if is_lion_config(trained) else trained
    changes = []
    for key in (*FIXED_BY_TRAINING, *HEADS) if is_lion_config(trained) else TEACHER_STRUCTURE:
        was, now = built_value(trained, key), built_value(building, key)
        if not _same_option(was, now):
            changes.append(f"{option_text(key, was)} -> {option_text(key, now)}")
    return changes


def safely_loaded(path: str) -> Any:
    """``path`` as torch's safe (``weights_only``) load reads it, memory-mapped where it can be; None where it
    cannot be read so (no torch file, or one holding more than tensors and plain containers)."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file of torch's format before 1.6, which mmap does not read
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - whatever the reason, not such a file
        return None


def bare_weights_message(path: str) -> Optional[str]:
    """What to say where ``path`` holds weights but no fairseq config to build the model from
    (``torch.save(model.state_dict())``, or such a dict under ``"model"``); None where it is something else
    (fairseq's own error stands)."""
    state = safely_loaded(path)
    weights = state.get("model", state) if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not weights or {"cfg", "args"} & set(state) or \
            not all(isinstance(value, torch.Tensor) for value in weights.values()):
        return None
    return (f"cannot load {path}: it holds {len(weights)} tensors by name and no config, a bare state_dict "
            "(torch.save(model.state_dict())), where a fairseq checkpoint keeps the config that builds the model "
            "beside its weights: pass a checkpoint fairseq-train saved (checkpoint_best.pt), or build the model and "
            "call its load_state_dict on these tensors")


def _wrap_load_checkpoint_to_cpu(original):
    def read(path, arg_overrides, load_on_all_ranks):
        try:
            with _allowed_in_checkpoints():
                return original(path, arg_overrides=arg_overrides, load_on_all_ranks=load_on_all_ranks)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
            if isinstance(e, CheckpointError) or not os.path.isfile(str(path)) or not _of_the_file(e):
                raise
            raise checkpoint_file_error(str(path), e) from e
        except KeyError as e:  # fairseq upgrading a file of no fairseq layout: KeyError: 'best_loss'
            message = bare_weights_message(str(path))
            if message is None:
                raise
            raise CheckpointError(message) from e

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        check_crc(str(path))  # once, though a legacy checkpoint may be read twice below
        fixed = {k: v for k, v in (arg_overrides or {}).items() if k in FIXED_BY_TRAINING}
        # checked against a LION checkpoint's trained values, so not applied (equal, they change nothing)
        state = read(path, {k: v for k, v in arg_overrides.items() if k not in fixed} if fixed else arg_overrides,
                     load_on_all_ranks)
        if fixed and not is_lion_config((state.get("cfg") or {}).get("model")):
            # fairseq's own options of its own models: applied, as fairseq applies them. Read again, as
            # fairseq reads a legacy checkpoint's config from its args, which only its own load overrides
            state, fixed = read(path, arg_overrides, load_on_all_ranks), {}
        model = (state.get("cfg") or {}).get("model")
        unknown = unknown_override_message(state.get("cfg"), arg_overrides or {})
        if unknown:
            raise ValueError(f"{path}: {unknown}")
        changed = changed_model_message(model, fixed) if fixed and model is not None else None
        if changed:
            raise ValueError(f"{path}: {changed}")
        bad = bad_switch_message(arg_overrides or {}) if is_lion_config(model) else None
        if bad:
            raise ValueError(f"{path}: {bad}")
        extra = state.get("extra_state") or {}
        if "converted_from" in extra and (extra.get("train_iterator") or {}).get("epoch") == 0:
            extra["train_iterator"]["epoch"] = 1  # converted before convert wrote it: fairseq's default is 0
        # for the trainer's check that a resumed run is the same model, which follows the read at once
        _TRAINED_AS.clear()
        _TRAINED_AS[str(path)] = model
        return state
    load_checkpoint_to_cpu.__lion_wrapped__ = True
    return load_checkpoint_to_cpu


def bad_switch_message(overrides: Dict[str, Any]) -> Optional[str]:
    """What is wrong with the values of the options a trained checkpoint switches (``lion_form``,
    ``lion_chunk_size``) in ``overrides``, in their spelling there (the model would name the training flag,
    which these tools do not take); None if nothing is."""
    from .ops.attention import FORMS, is_chunk_size

    wrong = []
    if "lion_form" in overrides and overrides["lion_form"] not in FORMS:
        wrong.append(f"'lion_form': {overrides['lion_form']!r} is none of {', '.join(map(repr, FORMS))}")
    if "lion_chunk_size" in overrides and not is_chunk_size(overrides["lion_chunk_size"]):
        wrong.append(f"'lion_chunk_size': {overrides['lion_chunk_size']!r} is no whole number >= 1 (written "
                     "without quotes, e.g. {'lion_chunk_size': 128})")
    if not wrong:
        return None
    return f"--model-overrides (or the hub's keyword arguments): {'; '.join(wrong)}"


def _options_of(arch: str) -> set:
    """The options of a LION arch's model (its dataclass's fields); empty for another arch."""
    import dataclasses

    from fairseq.models import ARCH_MODEL_NAME_REGISTRY, MODEL_DATACLASS_REGISTRY

    name = ARCH_MODEL_NAME_REGISTRY.get(arch, arch)
    config = MODEL_DATACLASS_REGISTRY.get(name) if str(name).startswith("lion") else None
    return {f.name for f in dataclasses.fields(config)} if config is not None else set()


# keys that fairseq's hub (``hub_utils.from_pretrained``, RoBERTa's) passes as overrides and reads itself
HUB_KEYS = {"data", "user_dir", "generation_args", "is_vocoder", "load_checkpoint_heads", "bpe_codes",
            "sentencepiece_model", "bpe_merges", "bpe_vocab"}


def _other_side(key: str, near: str) -> bool:
    """``key`` is ``near``'s encoder/decoder counterpart (``decoder_layerdrop`` near ``encoder_layerdrop``):
    the option of the other half of a model, which one override string may pass to both kinds, no typo."""
    return {key.split("_", 1)[0], near.split("_", 1)[0]} == {"encoder", "decoder"} and \
        key.split("_", 1)[1:] == near.split("_", 1)[1:]


def unknown_override_message(cfg: Any, overrides: Dict[str, Any]) -> Optional[str]:
    """What is wrong with ``overrides`` (``--model-overrides``, the hub's keyword arguments) on a LION
    checkpoint that fairseq would ignore without a word: a key its config (``cfg``, after the overrides) does
    not have and that is a LION option or a near miss of one it has (``lion_fom``). None if nothing is.
    Keys that fairseq's tools read themselves (``HUB_KEYS``) and the other half's option of an
    encoder-decoder pair are left to fairseq. On a checkpoint of fairseq's own models nothing is refused,
    as fairseq refuses nothing there: a near miss, or a LION option (one override string may serve both
    kinds of model), is logged. Configs kept as an ``argparse.Namespace`` take any key, so say nothing."""
    from omegaconf import DictConfig

    if not isinstance(cfg, DictConfig):
        return None
    known = set(cfg.keys())
    for section in cfg.values():
        if isinstance(section, DictConfig):
            known.update(section.keys())
        elif isinstance(section, argparse.Namespace):
            return None
    model = cfg.get("model")
    arch = model.get("_name", "?") if isinstance(model, DictConfig) else "?"
    newer = _options_of(arch)
    lion = is_lion_config(model)
    wrong = []
    for key in sorted(set(overrides) - known - HUB_KEYS):
        near = [n for n in difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8) if not _other_side(key, n)]
        if not near and f"lion_{key}" in known:  # 'form' for 'lion_form': too short a key for the ratio
            near = [f"lion_{key}"]
        if key in newer:  # the config was saved by a lion-fairseq without it (--encoder-layers-to-keep, say)
            wrong.append(f"{key!r} (an option of this model that its config, saved before the option existed, "
                         "has not: a run restarted with --restore-file and the option on the command line takes it)")
        elif lion and (near or key.startswith("lion_")):
            wrong.append(f"{key!r} ({'did you mean ' + repr(near[0]) if near else 'not an option of this model'})")
        elif near:
            logger.warning(f"--model-overrides {key!r}: not an option of this {arch} checkpoint (did you mean "
                           f"{near[0]!r}?); ignored, as fairseq ignores it")
        elif key.startswith("lion_"):
            logger.warning(f"--model-overrides {key!r}: a LION option, and this checkpoint is a {arch}; ignored, "
                           "as fairseq ignores it")
    if not wrong:
        return None
    return (f"--model-overrides (or the hub's keyword arguments) name what this checkpoint's config ({arch}) "
            f"does not have: {', '.join(wrong)}. fairseq would ignore them and run as trained; spell the "
            "option as its --flag without the dashes, with underscores (--lion-form -> 'lion_form')")


def _wrap_language_modeling_load_dataset(original):
    """Blocks of no token (``--tokens-per-sample`` 0, or in fairseq-eval-lm not above ``--context-window``,
    which it takes off each block) fail in fairseq's block builder with a division by zero or 'negative
    dimensions are not allowed': refused naming both options."""
    @functools.wraps(original)
    def load_dataset(self, split, *args, **kwargs):
        if self.args.tokens_per_sample < 1:
            raise ValueError(f"blocks of {self.args.tokens_per_sample} tokens: --tokens-per-sample must be above 0, "
                             "and in fairseq-eval-lm above --context-window, which it takes off each block (each "
                             "block scores the tokens after its context): lower --context-window or raise "
                             "--tokens-per-sample")
        return original(self, split, *args, **kwargs)
    load_dataset.__lion_wrapped__ = True
    return load_dataset


def _wrap_eval_lm_dataloader(original):
    """Over-long samples stop eval-lm where --tokens-per-sample made them, and are warned of under
    ``--sample-break-mode eos``, where they are the data's own lines whatever --tokens-per-sample."""
    @functools.wraps(original)
    def eval_lm_dataloader(self, dataset, *args, **kwargs):
        names = ["max_tokens", "batch_size", "max_positions", "num_shards", "shard_id", "num_workers",
                 "data_buffer_size", "context_window"]
        given = {**dict(zip(names, args)), **kwargs}
        limit, break_mode = given.get("max_positions"), str(getattr(self.args, "sample_break_mode", "none"))
        message = over_long_message(getattr(dataset, "sizes", None), limit, self.args.tokens_per_sample, break_mode,
                                    given.get("context_window") or 0)
        if message and break_mode != "eos" and self.args.tokens_per_sample > limit:
            raise ValueError(message)
        if message:
            logger.warning(message)
        return original(self, dataset, *args, **kwargs)
    eval_lm_dataloader.__lion_wrapped__ = True
    return eval_lm_dataloader


def tpu_message(common: Any) -> Optional[str]:
    """Where fairseq would take its TPU path without torch_xla (``fairseq-train --bf16`` sets ``--tpu``, and
    then fails in the trainer with "'NoneType' object has no attribute 'xla_device'"), what to do; else None."""
    import importlib.util

    if not getattr(common, "tpu", False) or importlib.util.find_spec("torch_xla") is not None:
        return None
    # fairseq-train turns --memory-efficient-bf16 into --bf16 too
    flag = "--memory-efficient-bf16" if getattr(common, "memory_efficient_bf16", False) else "--bf16"
    asked = f"{flag} (which fairseq-train turns into --tpu)" if getattr(common, "bf16", False) else "--tpu"
    return (f"{asked} runs fairseq's TPU code, and torch_xla is not installed. For bfloat16 on GPUs (or CPUs) "
            "use fairseq-hydra-train with common.fp16=false common.bf16=true (LION's configs: lion-fairseq's "
            "user_dir_examples/hydra); fairseq-train's --fp16 and --amp train in float16 instead, on GPUs")


def fp16_without_cuda_message(common: Any) -> Optional[str]:
    """Where fairseq-train ``--fp16`` would stop in its FP16Optimizer with "Torch not compiled with CUDA
    enabled" (or "no NVIDIA driver"), what to do; else None. ``--memory-efficient-fp16`` stops so at the loss
    scaler's first overflow (the trainer's CUDA tensor), ``--amp`` runs on CPUs, and LION's hydra configs set
    ``common.fp16: true``."""
    if not getattr(common, "fp16", False) or torch.cuda.is_available():
        return None
    flag = "--memory-efficient-fp16" if getattr(common, "memory_efficient_fp16", False) else "--fp16"
    return (f"{flag} trains with fairseq's fp16 optimizers, whose loss scaling needs a CUDA GPU, and torch sees none "
            f"here: leave {flag} out to train in float32 on CPUs (with --cpu; under fairseq-hydra-train "
            "common.fp16=false common.cpu=true, as LION's configs set common.fp16: true), or train in bfloat16 with "
            "fairseq-hydra-train common.fp16=false common.bf16=true common.cpu=true")


def fp16_and_bf16_message(common: Any) -> Optional[str]:
    """Where both ``common.fp16`` and ``common.bf16`` are set (``common.bf16=true`` over LION's hydra configs,
    which set ``common.fp16: true``), what to do; else None. fairseq then trains in float16 (fp16 decides the
    weights' dtype) without loss scaling (bf16 turns it off), and its trainer fails at the first overflow with
    "'NoneType' object has no attribute 'loss_scale'"."""
    if not getattr(common, "bf16", False) or not getattr(common, "fp16", False) or getattr(common, "tpu", False):
        return None
    return ("common.fp16 and common.bf16 are both true (LION's hydra configs set common.fp16: true): fairseq would "
            "train in float16 without loss scaling, and stop at the first overflow. For bfloat16 pass "
            "common.fp16=false common.bf16=true; for float16 leave common.bf16 out")


def _wrap_trainer_init(original):
    @functools.wraps(original)
    def __init__(self, cfg, *args, **kwargs):
        common = getattr(cfg, "common", cfg)  # cfg: a config, or a legacy Namespace
        # each names both launchers' terms
        message = tpu_message(common) or fp16_and_bf16_message(common) or fp16_without_cuda_message(common)
        if message:
            raise ValueError(message)
        original(self, cfg, *args, **kwargs)
    __init__.__lion_wrapped__ = True
    return __init__


# what scores a model of each kind that language_modeling does not take
OTHER_TOOLS = {
    "lion_transformer": "a translation model: fairseq-validate DATA --task translation gives its loss, "
                        "fairseq-generate its translations",
    "lion_roberta": "a masked LM: fairseq-validate DATA --task masked_lm --criterion masked_lm gives its loss",
    "lion_lra": "a Long Range Arena classifier: fairseq-validate DATA --task lra_<its task> gives its accuracy",
}


def not_a_language_model_message(model_cfg: Any) -> Optional[str]:
    """Where ``model_cfg`` (a checkpoint's, or the command line's) builds no causal language model, which
    ``--task language_modeling`` takes (fairseq-eval-lm), what the model is and what scores it; else None.
    fairseq fails on such a model with an AttributeError, or 'Unsupported language modeling target'."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY, FairseqLanguageModel

    name = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    cls = ARCH_MODEL_REGISTRY.get(name) or MODEL_REGISTRY.get(name)
    if cls is None or issubclass(cls, FairseqLanguageModel):
        return None
    kind = ARCH_MODEL_NAME_REGISTRY.get(name, name)
    return (f"--task language_modeling (fairseq-train, fairseq-eval-lm) takes causal language models, and this "
            f"checkpoint or command line holds a {kind} model (--arch {name}): "
            + OTHER_TOOLS.get(kind, "score it with fairseq-validate and the task it was trained with")
            + "; a causal LION LM is an arch of " + LION_MODELS["lion_lm"][2])


def _wrap_language_model_build(original):
    @functools.wraps(original)
    def build_model(self, cfg, *args, **kwargs):
        try:
            return original(self, cfg, *args, **kwargs)
        except (AttributeError, ValueError) as e:  # how fairseq fails on a model of another kind (its message)
            message = not_a_language_model_message(cfg)
            if message is None or isinstance(e, ValueError) and "language modeling target" not in str(e):
                raise
            raise ValueError(message) from e
    build_model.__lion_wrapped__ = True
    return build_model


# LION's models: what each is, the tasks it trains with, its archs
LION_MODELS = {
    "lion_roberta": ("an encoder (RoBERTa's kind)", ("masked_lm", "sentence_prediction"),
                     "lion_{lit,d,s}[_large|_tiny], lion_retnet"),
    "lion_lm": ("a causal language model", ("language_modeling",),
                "lion_{lit,d,s}_lm[_tiny], lion_retnet_lm, lion_s_lm_plus[_tiny]"),
    "lion_transformer": ("a translation model", ("translation",), "lion_{lit,d,s}_transformer[_tiny|_iwslt_de_en]"),
    "lion_lra": ("a Long Range Arena classifier",
                 ("lra_listops", "lra_text", "lra_retrieval", "lra_image", "lra_pathfinder", "lra_pathx"),
                 "lion_{lit,d,s}_lra_{listops,text,retrieval,image,pathfinder,pathx,small,tiny}"),
}


def wrong_task_message(args: Any) -> Optional[str]:
    """Where fairseq-train's ``--arch`` is a LION model that ``--task`` does not train (one of ``LION_MODELS``'
    tasks, for another of its models), what to pass; else None. fairseq stopped later with omegaconf's
    "Interpolation key 'task.max_target_positions' not found", or an AttributeError of the task."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    task, arch = getattr(args, "task", None), getattr(args, "arch", None)
    model = ARCH_MODEL_NAME_REGISTRY.get(arch) if isinstance(arch, str) else None
    if model not in LION_MODELS or not isinstance(task, str):
        return None
    takes = next((other for other, (_, tasks, _) in LION_MODELS.items() if task in tasks), model)
    if takes == model:  # its task, or one LION does not know (a user's own)
        return None
    what, tasks, _ = LION_MODELS[model]
    tasks = ", ".join(tasks[:-1]) + " or " + tasks[-1] if len(tasks) > 1 else tasks[0]
    return (f"--arch {arch} is {what}, which trains with --task {tasks}; --task {task} takes "
            f"{LION_MODELS[takes][0]}: pass an arch of {LION_MODELS[takes][2]} with it")


def check_task(args: Any) -> None:
    """Raise ``wrong_task_message`` where there is one (called by every LION arch function)."""
    message = wrong_task_message(args)
    if message:
        raise ValueError(message)


def lion_flags() -> Dict[str, str]:
    """Every ``--lion-*`` flag of LION's models (with the ``--no-`` form of a boolean) -> its config key."""
    import dataclasses

    from fairseq.models import MODEL_DATACLASS_REGISTRY

    flags = {}
    for model in LION_MODELS:
        for f in dataclasses.fields(MODEL_DATACLASS_REGISTRY[model]):
            if f.name.startswith("lion_"):
                flag = "--" + f.name.replace("_", "-")
                flags[flag] = f.name
                if f.type in (bool, Optional[bool]) and f.default is not False:  # --x/--no-x pairs
                    flags["--no-" + flag[2:]] = f.name
    return flags


def misplaced_lion_flag_message(flag: str, value: Optional[str], arch: Optional[str]) -> str:
    """What to do with LION's ``flag`` (``value`` as typed, None for none) on a command line without a model
    that takes it: fairseq-train with ``--arch`` another model (``arch``: "" where it is not known yet), or
    a tool that reads the model from its checkpoint (``arch`` None: fairseq-eval-lm, -validate, -generate,
    -interactive)."""
    import ast

    key = lion_flags()[flag]
    if arch is not None:
        owners = [f"{LION_MODELS[model][2]} ({LION_MODELS[model][0]})" for model in LION_MODELS
                  if key in _options_of(model)]
        owners = "every LION arch" if len(owners) == len(LION_MODELS) else "the archs " + " and ".join(owners)
        given = f"--arch {arch}" if arch else "the --arch given"
        return f"{flag} is an option of {owners}, not of {given}: leave it out"
    if key in FIXED_BY_TRAINING:
        return (f"{flag}: this command runs the checkpoint's model as it was trained, and {key} is set by "
                "training: leave it out (fairseq-train with the option trains or fine-tunes a model that has it)")
    if value is None:
        shown = "<value>"
    else:
        try:
            shown = repr(ast.literal_eval(value))  # 128, not '128'
        except (ValueError, SyntaxError):
            shown = repr(value)
    return (f"{flag}: this command takes the model's options from its checkpoint, and a trained checkpoint "
            f"switches {key} with --model-overrides \"{{'{key}': {shown}}}\"")


def _arch_given(namespace: argparse.Namespace) -> str:
    """fairseq-train's ``--arch`` as the parse will end with it (argparse keeps the last, and has not read one
    that comes after a misplaced flag yet): read from the strings being parsed, else the one read so far."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_name != "_parse_known_args":
        frame = frame.f_back
    strings = frame.f_locals.get("arg_strings") if frame is not None else None
    found = ""
    for i, arg in enumerate(strings if isinstance(strings, list) else []):
        if arg in ("--arch", "-a") and i + 1 < len(strings):
            found = strings[i + 1]
        elif arg.startswith("--arch="):
            found = arg[len("--arch="):]
    return found or getattr(namespace, "arch", None) or ""


class _MisplacedLionFlag(argparse.Action):
    def __init__(self, *args: Any, from_checkpoint: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.from_checkpoint = from_checkpoint

    def __call__(self, parser, namespace, values, option_string=None):
        arch = None if self.from_checkpoint else _arch_given(namespace)
        parser.error(misplaced_lion_flag_message(option_string, values, arch))


def refuse_misplaced_lion_flags(parser: argparse.ArgumentParser) -> None:
    """On a tool that reads the model from a checkpoint (it has ``--model-overrides``), or on fairseq-train
    with another model's ``--arch``, each LION flag the parser lacks stops it with what to pass (argparse
    said only "unrecognized arguments"). Hidden, and unset it adds nothing to the parsed arguments."""
    known = parser._option_string_actions
    if "--arch" not in known and "--model-overrides" not in known:
        return
    # fairseq-generate's parser has an --arch too (its default: wav2vec2), which builds nothing
    action = functools.partial(_MisplacedLionFlag, from_checkpoint="--model-overrides" in known)
    for flag in lion_flags():
        if flag not in known:
            parser.add_argument(flag, action=action, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _wrap_task_add_args(original):
    @functools.wraps(original)
    def add_args(cls, parser):
        original(cls, parser)
        refuse_misplaced_lion_flags(parser)
    add_args.__lion_wrapped__ = True
    return classmethod(add_args)


def over_long_message(sizes: Any, limit: Any, tokens_per_sample: int, break_mode: str = "none",
                      context_window: int = 0) -> Optional[str]:
    """What fairseq-eval-lm would silently leave out: samples of ``sizes`` (tokens, a numpy array) longer
    than the model's ``limit`` positions (an int; None or a tuple: no check). None if nothing.
    ``tokens_per_sample`` is eval-lm's, less ``context_window``."""
    if sizes is None or not isinstance(limit, int) or len(sizes) == 0:
        return None
    longer = sizes > limit
    if not longer.any():
        return None
    # --tokens-per-sample bounds the samples of "none", packs whole lines up to it under complete(_doc), and
    # leaves eos's lines whole; eval-lm reads each block with its context window, both within it
    within = (" with --context-window below it (eval-lm reads each block after up to that many tokens of context, "
              "--tokens-per-sample tokens in all)" if context_window else "")
    more = "" if context_window else \
        " (with --context-window N to give each scored token more context within them)"
    fix = (f"Pass --tokens-per-sample {min(limit, tokens_per_sample + context_window)} or less{within}"
           if break_mode == "none" else
           f"Pass --tokens-per-sample {limit} or less{within} (--sample-break-mode {break_mode} packs whole lines up "
           "to it, and keeps a longer line whole: --sample-break-mode none cuts those)"
           if break_mode in ("complete", "complete_doc") else
           f"--sample-break-mode {break_mode} keeps each line whole whatever --tokens-per-sample: pass "
           f"--sample-break-mode none --tokens-per-sample {limit} or less")
    return (f"fairseq-eval-lm: {int(longer.sum())} of {len(sizes)} samples are longer than the model's {limit} "
            f"positions, and fairseq skips them: the loss would cover {int(sizes[~longer].sum())} of "
            f"{int(sizes.sum())} tokens. {fix}{more}. Learned positions (LION-LIT's default, --lion-positions "
            "learned) end at the training length: to score beyond it use a model trained with --lion-positions "
            "none (LION-D and LION-S's default); sinusoidal ones (fairseq's transformer_lm), and LION-D and "
            "LION-S trained with --max-target-positions, go further with --model-overrides "
            "\"{'max_target_positions': N}\"")


def empty_split_message(path: str) -> str:
    return (f"data split {os.path.basename(str(path))!r} is empty: {path}.bin has no tokens (its text had no lines "
            "when fairseq-preprocess binarised it). Re-run fairseq-preprocess on a non-empty file, or name splits "
            "that have data: fairseq-train --valid-subset (or --disable-validation), fairseq-validate "
            "--valid-subset, fairseq-eval-lm and fairseq-generate --gen-subset")


def _wrap_load_indexed_dataset(original):
    @functools.wraps(original)
    def load_indexed_dataset(path, *args, **kwargs):
        # checked before fairseq's reader half-opens the file: its destructor then fails too, and that
        # unrelated error would be the last thing printed
        if os.path.isfile(f"{path}.bin") and os.path.getsize(f"{path}.bin") == 0:
            raise ValueError(empty_split_message(path))
        try:
            return original(path, *args, **kwargs)
        except ValueError as e:
            if "cannot mmap an empty file" not in str(e):
                raise
            raise ValueError(empty_split_message(path)) from e
    load_indexed_dataset.__lion_wrapped__ = True
    return load_indexed_dataset


def _wrap_distributed_model(original):
    @functools.wraps(original)
    def DistributedFairseqModel(args, model, process_group, device):
        backend = getattr(args, "ddp_backend", None)
        if torch.device(device).type == "cpu" and backend in ("c10d", "pytorch_ddp"):
            raise ValueError(
                f"--ddp-backend {backend} does not run on CPU in fairseq 0.12 (it passes a CUDA device id to "
                "torch's DistributedDataParallel): on CPU (--cpu --distributed-backend gloo) pass "
                "--ddp-backend legacy_ddp (alias no_c10d), which gives the same updates")
        return original(args, model, process_group, device)
    DistributedFairseqModel.__lion_wrapped__ = True
    return DistributedFairseqModel


def has_linear_cross_attention(models: List[torch.nn.Module]) -> bool:
    from .modules.seq2seq_attention import LinearCrossAttention

    return any(isinstance(m, LinearCrossAttention) for model in models for m in model.modules())


def alignment_message(models: List[torch.nn.Module], args: Any) -> Optional[str]:
    """Where ``--print-alignment`` is asked of a model with linear cross-attention, which forms no weights
    over the source to align with (fairseq fails transposing an empty tensor), what to do; else None."""
    if not getattr(args, "print_alignment", False) or not has_linear_cross_attention(models):
        return None
    return ("--print-alignment reads the decoder's attention weights over the source, and this model's linear "
            "cross-attention (--lion-cross-attention linear) forms none: leave out --print-alignment, or align "
            "with a model trained with --lion-cross-attention softmax (the default)")


class AttentionLeftOut:
    """A model as fairseq's ``SequenceScorer`` calls it (``eval``, forward, ``get_normalized_probs``), the
    attention over the source left out of its decoder output."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        if len(out) < 2:
            return out
        extra = {**out[1], "attn": None} if isinstance(out[1], dict) else None
        return (out[0], extra, *out[2:])


def score_without_attention(generate):
    """``SequenceScorer.generate`` for an ensemble with linear cross-attention, which forms no attention: the
    scorer summed each model's attention (``add_`` of None failed after a softmax model's, and a softmax model
    after a linear one gave its own halved) for alignment only, which such a model refuses
    (:func:`alignment_message`). Every model's is left out, as a linear model alone gives none."""
    @functools.wraps(generate)
    def generate_without_attention(models, sample, **kwargs):
        return generate([AttentionLeftOut(model) for model in models], sample, **kwargs)
    return generate_without_attention


def _wrap_build_generator(original):
    @functools.wraps(original)
    def build_generator(self, models, args, *rest, **kwargs):
        from fairseq.sequence_scorer import SequenceScorer

        message = alignment_message(models, args)
        if message:
            raise ValueError(message)
        generator = original(self, models, args, *rest, **kwargs)
        if isinstance(generator, SequenceScorer) and has_linear_cross_attention(models):
            generator.generate = score_without_attention(generator.generate)
        return generator
    build_generator.__lion_wrapped__ = True
    return build_generator


def unknown_model_message(cfg: Any) -> Optional[str]:
    """Where ``cfg`` names a model fairseq has not registered (``model._name`` under fairseq-hydra-train, a
    checkpoint's), what it is closest to; else None. fairseq's own assertion formats the config into its
    message and stops with ``KeyError: "'_name'"`` instead."""
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY

    name = getattr(cfg, "_name", None) or getattr(cfg, "arch", None)
    if not isinstance(name, str) or name in ARCH_MODEL_REGISTRY or name in MODEL_DATACLASS_REGISTRY:
        return None
    near = difflib.get_close_matches(name, sorted({*ARCH_MODEL_REGISTRY, *MODEL_DATACLASS_REGISTRY}), n=1)
    return (f"model {name!r} is no model or arch fairseq knows" + (f": did you mean {near[0]!r}?" if near else "")
            + " (LION's models: " + "; ".join(f"{m}, archs {LION_MODELS[m][2]}" for m in LION_MODELS) + ")")


def _wrap_build_model(original):
    @functools.wraps(original)
    def build_model(cfg, *args, **kwargs):
        message = unknown_model_message(cfg)
        if message:
            raise ValueError(message)
        try:
            return original(cfg, *args, **kwargs)
        except ValueError as e:  # LION's options named as fairseq-train spells them
            if not launched_by_hydra() or "--" not in str(e):
                raise
            raise ValueError(in_launchers_terms(str(e))) from e
    build_model.__lion_wrapped__ = True
    return build_model


def num_classes_message(task: Any) -> Optional[str]:
    """Where a sentence_prediction task's ``--num-classes`` is below the labels its label dictionary holds,
    what to pass; else None (fairseq stopped at the first batch with such a label: "IndexError: Target 1 is
    out of bounds"). Above them, it logs the classes no example has."""
    cfg, labels = task.cfg, getattr(task, "label_dictionary", None)
    if getattr(cfg, "regression_target", False) or labels is None or labels is task.source_dictionary:
        return None
    # fairseq-preprocess pads a dictionary with unused madeupword entries (count 0), and the task adds <mask>
    names = [name for name, count in zip(labels.symbols[labels.nspecial:], labels.count[labels.nspecial:])
             if count > 0 and name != "<mask>"]
    where = os.path.join(str(cfg.data), "label", "dict.txt")
    if cfg.num_classes < len(names):
        return in_launchers_terms(f"--num-classes {cfg.num_classes}, and {where} holds {len(names)} labels "
                                  f"({', '.join(names[:10])}{', ...' if len(names) > 10 else ''}): pass "
                                  f"--num-classes {len(names)}")
    if cfg.num_classes > len(names):
        logger.warning(f"--num-classes {cfg.num_classes}, and {where} holds {len(names)} labels: the classification "
                       f"head has {cfg.num_classes - len(names)} classes that no example has")
    return None


def _wrap_sentence_prediction_build(original):
    @functools.wraps(original)
    def build_model(self, cfg, *args, **kwargs):
        message = num_classes_message(self)
        if message:
            raise ValueError(message)
        return original(self, cfg, *args, **kwargs)
    build_model.__lion_wrapped__ = True
    return build_model


def _checkpoint_folder() -> Optional[str]:
    """The folder of the first checkpoint that this fairseq command's ``--path`` names; None without one."""
    for i, arg in enumerate(sys.argv):
        value = sys.argv[i + 1] if arg == "--path" and i + 1 < len(sys.argv) else \
            arg[len("--path="):] if arg.startswith("--path=") else None
        if value:
            return os.path.dirname(os.path.abspath(value.split(os.pathsep)[0]))
    return None


def _wrap_build_bpe(original):
    """fairseq-interactive without ``--bpe`` on data that ``python -m preprocess.text`` made split its input on
    whitespace: every word it reads is ``<unk>`` to a sentencepiece dictionary, without a word. Where the data
    folder (or, as for the hubs, the checkpoint's) holds ``sentencepiece.bpe.model`` it encodes with that, and
    says so; ``--bpe sentencepiece`` without ``--sentencepiece-model`` takes it too (it stopped on a missing
    mandatory value)."""
    @functools.wraps(original)
    def build_bpe(self, args):
        from omegaconf import OmegaConf, open_dict

        from .models.hub import SPM, data_sentencepiece

        data = getattr(getattr(self, "cfg", None), "data", None) or getattr(getattr(self, "args", None), "data", None)
        path = data_sentencepiece([str(data).split(os.pathsep)[0] if data else None, _checkpoint_folder()])
        name = getattr(args, "_name", None) or getattr(args, "bpe", None) if args is not None else None
        if path and name == "sentencepiece" and OmegaConf.is_config(args) \
                and OmegaConf.is_missing(args, "sentencepiece_model"):
            with open_dict(args):
                args.sentencepiece_model = path
        elif path and name is None and os.path.basename(sys.argv[0]) in ("fairseq-interactive", "interactive.py"):
            if any(a.startswith(("--post-process", "--remove-bpe")) for a in sys.argv):  # pieces typed in
                logger.warning("no --bpe given, and --post-process/--remove-bpe: the input is read as sentencepiece "
                               "pieces, as fairseq reads it (plain text would be <unk>); to encode plain text with "
                               f"the data's {SPM}, leave --post-process out, or pass --bpe sentencepiece")
            else:
                logger.warning(f"no --bpe given: encoding with {path} (pass --bpe and its options "
                               "for another; the input split on whitespace would read every word as <unk>)")
                from .models.hub import sentencepiece_bpe

                return sentencepiece_bpe(path)
        return original(self, args)
    build_bpe.__lion_wrapped__ = True
    return build_bpe


def install() -> None:
    """Wrap fairseq's checkpoint readers, dataset loader, DDP wrapper and eval-lm batches (idempotent)."""
    from fairseq import checkpoint_utils, models
    from fairseq.data import data_utils

    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, "__lion_wrapped__", False):
        checkpoint_utils.load_checkpoint_to_cpu = _wrap_load_checkpoint_to_cpu(checkpoint_utils.load_checkpoint_to_cpu)
    if not getattr(data_utils.load_indexed_dataset, "__lion_wrapped__", False):
        data_utils.load_indexed_dataset = _wrap_load_indexed_dataset(data_utils.load_indexed_dataset)
    if not getattr(models.DistributedFairseqModel, "__lion_wrapped__", False):
        models.DistributedFairseqModel = _wrap_distributed_model(models.DistributedFairseqModel)
    from fairseq.trainer import Trainer

    if not getattr(Trainer.load_checkpoint, "__lion_wrapped__", False):
        Trainer.load_checkpoint = _wrap_trainer_load_checkpoint(Trainer.load_checkpoint)
    from fairseq.distributed import utils as distributed_utils

    if not getattr(distributed_utils.broadcast_object, "__lion_wrapped__", False):
        distributed_utils.broadcast_object = _wrap_broadcast_object(distributed_utils.broadcast_object)
    if not getattr(Trainer.__init__, "__lion_wrapped__", False):
        Trainer.__init__ = _wrap_trainer_init(Trainer.__init__)
    from fairseq.tasks.language_modeling import LanguageModelingTask

    if not getattr(LanguageModelingTask.eval_lm_dataloader, "__lion_wrapped__", False):
        LanguageModelingTask.eval_lm_dataloader = _wrap_eval_lm_dataloader(LanguageModelingTask.eval_lm_dataloader)
    if not getattr(LanguageModelingTask.load_dataset, "__lion_wrapped__", False):
        LanguageModelingTask.load_dataset = _wrap_language_modeling_load_dataset(LanguageModelingTask.load_dataset)
    if not getattr(LanguageModelingTask.build_model, "__lion_wrapped__", False):
        LanguageModelingTask.build_model = _wrap_language_model_build(LanguageModelingTask.build_model)
    from fairseq.tasks import FairseqTask

    if not getattr(FairseqTask.build_generator, "__lion_wrapped__", False):
        FairseqTask.build_generator = _wrap_build_generator(FairseqTask.build_generator)
    # fairseq-train and the evaluation tools add the task's options after the model's: a LION flag still
    # missing then has no model to take it
    if not getattr(FairseqTask.add_args, "__lion_wrapped__", False):
        FairseqTask.add_args = _wrap_task_add_args(FairseqTask.__dict__["add_args"].__func__)
    if not getattr(models.build_model, "__lion_wrapped__", False):
        models.build_model = _wrap_build_model(models.build_model)
    from fairseq.tasks.sentence_prediction import SentencePredictionTask

    if not getattr(SentencePredictionTask.build_model, "__lion_wrapped__", False):
        SentencePredictionTask.build_model = _wrap_sentence_prediction_build(SentencePredictionTask.build_model)
    if not getattr(FairseqTask.get_batch_iterator, "__lion_wrapped__", False):
        FairseqTask.get_batch_iterator = _wrap_get_batch_iterator(FairseqTask.get_batch_iterator)
    if not getattr(FairseqTask.build_bpe, "__lion_wrapped__", False):
        FairseqTask.build_bpe = _wrap_build_bpe(FairseqTask.build_bpe)


def left_out_message(split: str, total: int, covered: int, multiple: int) -> Optional[str]:
    """What to say where fairseq's batches of an evaluated split cover ``covered`` of its ``total`` samples."""
    if covered >= total:
        return None
    return (f"fairseq's batches leave out {total - covered} of the {total} samples of '{split}' "
            f"(--required-batch-size-multiple {multiple} drops a last batch of another size: fairseq #5036), the same "
            "ones at every evaluation, so its loss and metrics leave them out too: pass --required-batch-size-multiple "
            "1 to evaluate them all")


# the task option that cuts every sample to N tokens, by task
CUT_TO = {"language_modeling": "--tokens-per-sample {n} or less", "masked_lm": "--tokens-per-sample {n} or less",
          "sentence_prediction": "--max-positions {n} --shorten-method truncate"}


def all_skipped_message(split: Optional[str], samples: int, limit: Any, task: Optional[str] = None,
                        max_tokens: Optional[int] = None) -> str:
    """What to say where fairseq skipped every sample of ``split`` (None: a dataset of no split's name) as
    longer than ``limit``, the least of ``max_tokens`` and the task's and model's positions, in ``task``."""
    which = repr(split) if split else "the data"
    n = limit if isinstance(limit, int) else "N"
    cut = ("--max-positions {n} (the task cuts every example to it)" if str(task).startswith("lra_") else
           CUT_TO.get(str(task), "shorter samples")).format(n=n)
    if max_tokens is not None and limit == max_tokens:  # where the positions end there too, a cut still helps
        fix = f"Pass a larger --max-tokens ({max_tokens} now); where the positions end there too, {cut}"
    else:
        fix = f"Pass {cut}" + (", or a larger --max-tokens" if max_tokens is not None else "")
    return (f"fairseq skipped every one of the {samples} samples of {which}: each is longer than {limit} tokens, "
            "the most this run takes (the least of --max-tokens and the task's and the model's positions; a LION-LIT "
            "model's learned positions end at the --max-positions or --max-target-positions it was built with). "
            + fix)


def _wrap_get_batch_iterator(original):
    """Where fairseq batches a split that it evaluates (validation in fairseq-train, fairseq-validate,
    fairseq-generate) with ``--required-batch-size-multiple`` above 1, it drops the samples of a last batch
    that is no multiple (fairseq #5036) without a word: said once per split, with what to pass. Training
    splits are left alone (a few samples an epoch, and the multiple is what a GPU is fed). A split whose
    every sample is too long for the run stops saying so (fairseq: an IndexError, 'The dataset is empty', or
    a division by zero after evaluating nothing)."""
    import inspect

    signature = inspect.signature(original)
    counted = set()  # the evaluated splits whose batches were counted: once each

    def kept(self, dataset, a) -> int:
        """The samples fairseq batches: its ordered indices, less those longer than max_positions."""
        from fairseq.data import data_utils

        with data_utils.numpy_seed(a["seed"] + a["epoch"]):  # as fairseq orders them
            indices = dataset.ordered_indices()
        if a["max_positions"] is not None:
            indices, _ = dataset.filter_indices_by_size(indices, a["max_positions"])
        return len(indices)

    @functools.wraps(original)
    def get_batch_iterator(self, dataset, *args, **kwargs):
        try:
            call = signature.bind(self, dataset, *args, **kwargs)
        except TypeError:  # arguments fairseq's own does not take: its error, as it gives it
            return original(self, dataset, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        split = next((name for name, d in getattr(self, "datasets", {}).items() if d is dataset), None)

        def skipped() -> str:  # the task's name looked up only for the message
            from fairseq.tasks import TASK_REGISTRY

            name = next((name for name, cls in TASK_REGISTRY.items() if type(self) is cls), None)
            return all_skipped_message(split, len(dataset), a["max_positions"], name, a["max_tokens"])

        try:
            itr = original(self, dataset, *args, **kwargs)
        except IndexError as e:  # fairseq's batch_by_size on no indices
            if a["max_positions"] is not None and len(dataset) and kept(self, dataset, a) == 0:
                raise ValueError(skipped()) from e
            raise
        batches = itr.frozen_batches
        multiple = a["required_batch_size_multiple"]
        if not batches and len(dataset):
            try:
                total = kept(self, dataset, a)
            except Exception:  # noqa: BLE001 - a dataset that orders or filters otherwise: said as all skipped
                total = 0
            if total == 0 and a["max_positions"] is not None:
                raise ValueError(skipped())
            if total and multiple > 1 and split is not None and not split.startswith("train"):
                # fewer samples than the multiple: fairseq would evaluate nothing (a division by zero)
                raise ValueError(left_out_message(split, total, 0, multiple))
        if multiple <= 1 or split is None or split.startswith("train") or split in counted:
            return itr
        counted.add(split)
        try:
            total = kept(self, dataset, a)
        except Exception:  # noqa: BLE001 - a dataset that orders or filters otherwise: say nothing
            return itr
        message = left_out_message(split, total, sum(len(b) for b in batches), multiple)
        if message:
            logger.warning(message)
        return itr
    get_batch_iterator.__lion_wrapped__ = True
    return get_batch_iterator


# ---- a checkpoint of another architecture -------------------------------------------------------------

def describe_weights(state_dict: Dict[str, torch.Tensor], lion: Optional[bool] = None) -> str:
    """A LION model's shape read from its weights: variant, layers, width (or 'not a LION model'). ``lion``:
    whether the config says it is a LION model (None: unknown, and weights without gates may be either)."""
    facts = _facts(state_dict)
    variant = {"s": "lion_s (a gate per token)", "d": "lion_d (one gate per head)"}.get(facts["variant"])
    if variant is None:
        kinds = {None: "lion_lit (no gates) or a softmax Transformer", True: "lion_lit (no gates)",
                 False: "a softmax Transformer"}
        # a softmax model's older layouts too (a released RoBERTa's combined in_proj)
        attention = ".self_attn." if lion is False else ".self_attn.q_proj."
        variant = kinds[lion] if any(attention in k for k in state_dict) else "not a LION model"
    from .models.convert import _layers

    depth = {side: _layers(state_dict, side + ".") for side in ("encoder", "decoder")}  # a translation model's
    layers = (f"{depth['encoder']} encoder and {depth['decoder']} decoder layers" if all(depth.values())
              else f"{facts['layers']} layers")
    return f"{variant}, {layers}, width {facts['width']}"


def _facts(state_dict: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """What a LION model's weights say of its options: positions, variant, sizes, levers."""
    keys = list(state_dict)

    def first_shape(suffix: str):
        return next((tuple(state_dict[k].shape) for k in keys if k.endswith(suffix)), None)

    positions = first_shape("embed_positions.weight")
    conv = first_shape("self_attn.conv_weight")
    ffn = first_shape("fc1.weight")
    tokens = first_shape("embed_tokens.weight")
    return {
        # learned positions: max_positions + padding_idx (1) + 1 rows
        "positions": positions[0] - 2 if positions else None,
        "variant": ("s" if any(".gate_proj." in k for k in keys) else
                    "d" if any(k.endswith(".gate_logit") for k in keys) else "lit"),
        "layers": len({m.group(1) for k in keys for m in [re.search(r"\blayers\.(\d+)\.", k)] if m}),
        "width": tokens[-1] if tokens else None,
        "ffn": ffn[0] if ffn else None,
        "output gate": any(".self_attn.out_gate." in k for k in keys),
        "short conv": conv[0] if conv else 0,
        "norm after": any(".self_attn.head_norm." in k for k in keys),
    }


# the start of first_difference's answer where only the embeddings' rows differ: the data folder, not the model
DICTIONARY_DIFFERS = "the dictionary"


def first_difference(checkpoint: Dict[str, torch.Tensor], model: Dict[str, torch.Tensor]) -> Optional[str]:
    """The first option in which a checkpoint's weights and a model's differ, said with what to pass:
    variant, positions, sizes, then the levers (None if the weights agree on all of them)."""
    a, b = _facts(checkpoint), _facts(model)
    stack = "decoder" if any(k.startswith("decoder.layers.") for k in model) else "encoder"
    # the variant first: its arch brings its default positions (learned for LIT, none for D and S)
    if a["variant"] != b["variant"]:
        v = a["variant"]
        return (f"the LION variant: the checkpoint is LION-{v.upper()} and the model LION-{b['variant'].upper()}; "
                f"pass an --arch of LION-{v.upper()} (lion_{v}, lion_{v}_lm, lion_{v}_transformer or "
                f"lion_{v}_lra_<task>, with the size the checkpoint was trained at)")
    if a["positions"] != b["positions"]:
        if a["positions"] is None or b["positions"] is None:
            # a translation model without learned ones has fairseq's sinusoidal positions (or none)
            translation = all(any(k.startswith(f"{s}.layers.") for k in model) for s in ("encoder", "decoder"))
            none = "no learned positions" if translation else "no positions"
            has = lambda n: f"{n} learned positions" if n else none  # noqa: E731
            fairseqs = (" (fairseq's --encoder-learned-pos --decoder-learned-pos)" if translation and a["positions"]
                        else "")
            return (f"positions: the checkpoint has {has(a['positions'])} and the model {has(b['positions'])}; "
                    f"pass --lion-positions {'learned' if a['positions'] else 'none'}{fairseqs}")
        n = a["positions"]
        # masked_lm sizes the encoder's positions by --tokens-per-sample: --max-positions alone would leave its
        # samples longer than the positions, every one skipped, and the run stopping on an empty dataset
        option = (f"--tokens-per-sample {n}" if stack == "decoder" else
                  f"--max-positions {n} (in masked_lm --tokens-per-sample {n}, which sets it)")
        return (f"learned positions: the checkpoint has {n} and the model {b['positions']}; pass {option}, the "
                "length it was trained with: learned positions have no weights past it, so no --model-overrides or "
                "hub keyword of a longer one adds any")
    # every size at once: a run per size was a user's way to find them
    sizes = [(fact, option) for fact, option in (("layers", f"--{stack}-layers"), ("width", f"--{stack}-embed-dim"),
                                                 ("ffn", f"--{stack}-ffn-embed-dim")) if a[fact] != b[fact]]
    if sizes:
        heads = (f" (and --{stack}-attention-heads that divides {a['width']}: the checkpoint's own, which its weights "
                 "do not show; python -m lion_fairseq.check_checkpoint reads it from its config)"
                 if a["width"] != b["width"] else "")
        return (f"{' and '.join(fact for fact, _ in sizes)}: the checkpoint has "
                f"{', '.join(str(a[fact]) for fact, _ in sizes)} and the model "
                f"{', '.join(str(b[fact]) for fact, _ in sizes)}; pass "
                f"{' '.join(f'{option} {a[fact]}' for fact, option in sizes)}{heads}")
    for fact, option in (("output gate", "--lion-output-gate"), ("short conv", "--lion-short-conv"),
                         ("norm after", "--lion-norm-after")):
        if a[fact] != b[fact]:
            if isinstance(a[fact], bool):  # a flag: what to do with it, not its value
                was, built = ("with" if a[fact] else "without"), ("with" if b[fact] else "without")
                return (f"{option}: the checkpoint was trained {was} it and the model is built {built} it; "
                        f"{'pass' if a[fact] else 'leave out'} {option}")
            return (f"{option}: the checkpoint has {a[fact]} and the model {b[fact]}; "
                    + (f"pass {option} {a[fact]}" if a[fact] else f"leave out {option}"))
    for key in sorted(k for k in model if k.endswith("embed_tokens.weight") and k in checkpoint):
        rows, built = checkpoint[key].shape[0], model[key].shape[0]
        if rows != built:
            return (f"{DICTIONARY_DIFFERS} ({key}: the checkpoint has {rows} rows, one per entry of the dictionary "
                    f"it was trained with, and the model {built}, from the data folder's): pass the data folder "
                    "(data-bin) the checkpoint was trained on, whose dict*.txt it was built with, or binarise this "
                    "data with that dictionary (fairseq-preprocess --srcdict; python -m preprocess.text "
                    "--spm-model <that data-bin>/sentencepiece.bpe.model; the GLUE recipe's prepare.sh takes the "
                    "pretraining data-bin)")
    return None


def load_error_message(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor], error: BaseException) -> str:
    """One line, ending with the first real difference and what to pass (the line a user reads last)."""
    difference = first_difference(state_dict, model.state_dict())
    torch_said = " ".join(str(error).split())[:600]
    if difference and difference.startswith(DICTIONARY_DIFFERS):  # the model is right, the data folder is not
        return (f"this checkpoint's weights do not fit the model being built (torch: {torch_said[:300]}): they "
                f"differ in {difference}.")
    theirs, ours = describe_weights(state_dict), describe_weights(model.state_dict())
    shapes = f" The checkpoint holds {theirs}; the model is {ours}." if theirs != ours else ""
    return (f"this checkpoint's weights do not fit the model being built (torch: {torch_said}).{shapes} To "
            "continue or fine-tune it, build the model it was trained as; to evaluate or generate with it, leave "
            "out the --model-overrides or hub keyword that changed it; to train a different architecture from "
            "scratch, use a new --save-dir (fairseq-train resumes from <save-dir>/checkpoint_last.pt) without "
            "--restore-file or --finetune-from-model. "
            + (f"They differ first in {difference}." if difference else
               "Pass the checkpoint's own --arch and size options."))


def _from_launch_folder(filename: str) -> Optional[str]:
    """Under fairseq-hydra-train, which runs in hydra's run folder (``hydra.run.dir``): the relative path
    ``filename`` read from the folder it was launched from, where a file is there; else None."""
    if os.path.isabs(filename) or not launched_by_hydra():
        return None
    try:
        from hydra.utils import get_original_cwd

        launched = os.path.join(get_original_cwd(), filename)
    except (ImportError, ValueError):  # hydra not set up in this process (a spawned rank)
        return None
    return launched if os.path.isfile(launched) else None


def saved_names(suffix: str) -> "re.Pattern[str]":
    """The names fairseq-train writes in --save-dir with ``--checkpoint-suffix suffix`` (and a shard's)."""
    return re.compile(rf"checkpoint(_last|_best|\d+|_\d+_\d+|\.best_.+){re.escape(suffix)}(-shard\d+)?\.pt")


def written_by_this_run(path: str, checkpoint_cfg: Any) -> bool:
    """Whether fairseq-train saves over ``path``: a name it writes (with the run's ``--checkpoint-suffix``)
    in the run's ``--save-dir``."""
    suffix = str(getattr(checkpoint_cfg, "checkpoint_suffix", "") or "")
    save_dir = str(getattr(checkpoint_cfg, "save_dir", "") or "")
    return bool(saved_names(suffix).fullmatch(os.path.basename(path))) \
        and os.path.realpath(os.path.dirname(os.path.abspath(path))) == os.path.realpath(save_dir)


def finetune_in_save_dir_message(checkpoint_cfg: Any) -> Optional[str]:
    """What to say where ``--finetune-from-model`` names a file in ``--save-dir`` that fairseq-train writes
    there (fairseq's default ``checkpoints`` for both runs, say): the run would save over it, and where the
    folder holds a checkpoint_last.pt fairseq resumes that instead of fine-tuning. None otherwise."""
    pretrained = getattr(checkpoint_cfg, "finetune_from_model", None)
    save_dir = str(getattr(checkpoint_cfg, "save_dir", "") or "")
    suffix = str(getattr(checkpoint_cfg, "checkpoint_suffix", "") or "")
    if not pretrained or not written_by_this_run(pretrained, checkpoint_cfg):
        return None
    last = os.path.join(save_dir, f"checkpoint_last{suffix}.pt")
    resumed = (f"; and fairseq resumes {last} instead, the run that is there, without fine-tuning from it"
               if os.path.isfile(last) else "")
    return (f"--finetune-from-model {pretrained} lies in --save-dir {save_dir}, under a name this run writes: it "
            f"would save over it{resumed}. Pass a new --save-dir for the fine-tuned model")


def missing_restore_file_message(filename: str, checkpoint_cfg: Any) -> Optional[str]:
    """What to say where fairseq would train from random weights because ``--restore-file`` names a file that
    does not exist. A missing ``checkpoint_last.pt`` (the default, or a path ending in that name) is how a
    resumable run's first launch starts fresh, and stays allowed unless ``--reset-*`` options say the run is
    to start from it; any other missing file is a wrong path."""
    from fairseq.file_io import PathManager

    if os.path.isdir(filename):  # fairseq takes a folder for a file, then finds no checkpoint in it
        option, name = (("--finetune-from-model", "checkpoint_best.pt")
                        if filename == getattr(checkpoint_cfg, "finetune_from_model", None)
                        else ("--restore-file", "checkpoint_last.pt"))
        return (f"{option} {filename} is a folder, and fairseq would train from random weights instead: pass a "
                f"checkpoint file in it (its {name}, say)")
    if getattr(checkpoint_cfg, "restore_file", "checkpoint_last.pt") == "checkpoint_last.pt" \
            or PathManager.isfile(filename):
        return None
    launched = _from_launch_folder(filename)
    if launched:  # also for a checkpoint_last.pt: the user's file is there, and would be passed over
        return (f"--restore-file {filename} does not exist in hydra's run folder {os.getcwd()}, which is where "
                "fairseq-hydra-train reads a relative path from, and fairseq would train from random weights instead: "
                f"pass its absolute path, {launched}")
    typed = str(getattr(checkpoint_cfg, "restore_file", "") or "")
    if typed != filename and PathManager.isfile(typed):  # fairseq put --checkpoint-suffix into the name
        suffix = getattr(checkpoint_cfg, "checkpoint_suffix", "")
        return (f"--restore-file {typed} is read as {filename}, which does not exist: fairseq adds --checkpoint-suffix "
                f"{suffix} to that name too, and would train from random weights instead. To start from {typed}, "
                "pass it as --finetune-from-model (read as given, for a new run) or copy it to that name")
    resets = [f"--{name.replace('_', '-')}" for name in ("reset_optimizer", "reset_lr_scheduler", "reset_meters",
                                                         "reset_dataloader") if getattr(checkpoint_cfg, name, False)]
    # fairseq reads any other name than the default from the current folder, not from --save-dir
    beside = os.path.join(str(getattr(checkpoint_cfg, "save_dir", "") or ""), filename)
    relative = (f" (a relative path is read from the current folder, not --save-dir: pass --restore-file {beside}, "
                "which exists)" if not os.path.isabs(filename) and os.path.isfile(beside) else "")
    if resets:
        return (f"--restore-file {filename} does not exist{relative}. With {' '.join(resets)} the run starts from "
                "that checkpoint, and fairseq would train from random weights instead: correct the path (or leave "
                "--restore-file out to train from scratch)")
    if os.path.basename(filename) == "checkpoint_last.pt":
        return None
    return (f"--restore-file {filename} does not exist{relative}, and fairseq would train from random weights "
            "instead: correct the path, or leave --restore-file out to train from scratch (a run resumes from "
            "<save-dir>/checkpoint_last.pt without it)")


def other_kind_message(filename: str, model_cfg: Any) -> Optional[str]:
    """Where ``filename`` holds a kind of model that the one being built does not start from (a translation
    model's weights given to a causal LM, say), what to pick instead; None otherwise. The weights'
    first difference would otherwise name an option that cannot make them fit."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    from .convert import ARCHS, TARGETS, teacher_config, trained_model

    try:
        arch, theirs = trained_model(teacher_config(load_checkpoint_file(filename)))
    except Exception:
        return None
    ours = ARCH_MODEL_NAME_REGISTRY.get(getattr(model_cfg, "_name", None))
    if theirs is None or ours not in TARGETS or theirs in (ours, TARGETS[ours].teacher):
        return None
    # an arch of the checkpoint's kind, with that kind's task (a causal LM's weights train under language_modeling)
    fits = [f"{ARCHS[kind]} with {' '.join(target.task[:2])}" for kind, target in TARGETS.items()
            if theirs in (kind, target.teacher)]
    return (f"it holds a {theirs} model (--arch {arch}), and --arch {model_cfg._name} builds a {ours}, which starts "
            f"from a {ours} or a fairseq {TARGETS[ours].teacher} checkpoint: "
            + (f"pick an arch of {fits[0]}" if fits else "start from a checkpoint of that kind"))


def trained_as_options(model_cfg: Any) -> Optional[str]:
    """A LION checkpoint's arch, sizes, structure and LION options as the command line gives them
    (``--arch lion_s_tiny --encoder-layers 2 ... --lion-feature-map silu_norm``), for a model built otherwise
    or fine-tuned from it; None for other checkpoints. The LION options are those the checkpoint's config
    sets (with the feature map and positions as they resolve), which a model of the same arch would
    otherwise take from the arch and the dataclass defaults."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    from .convert import TARGETS, _sizes, teacher_flags
    from .models.lion_options import built_value

    if model_cfg is None:
        return None
    if isinstance(model_cfg, dict):  # the plain dict a checkpoint file holds
        model_cfg = argparse.Namespace(**model_cfg)
    get = lambda key: getattr(model_cfg, key, None)  # noqa: E731
    arch = get("_name")
    if not str(arch).startswith("lion"):
        return None
    words = [f"--arch {arch}", *(f"{options[0]} {get(key)}" for key, options in _sizes("encoder", "decoder").items()
                                 if get(key) is not None)]
    target = TARGETS.get(ARCH_MODEL_NAME_REGISTRY.get(arch))
    if target is not None:  # pre- or post-norm layers, an embedding LayerNorm: what the weights are laid out for
        words += teacher_flags({key: get(key) for key in target.switches}, target, [])
    for key in FIXED_BY_TRAINING:
        if get(key) is None and key not in ("lion_feature_map", "lion_positions"):
            continue  # the arch decides, as it did in training
        text = option_text(key, built_value(model_cfg, key))
        if not text.startswith("no "):  # an option left out (unset, or a flag that is off)
            words.append(text)
    return " ".join(words)


def launched_by_hydra() -> bool:
    """Whether this process is fairseq-hydra-train (its console script, or ``python -m fairseq_cli.hydra_train``)."""
    return os.path.basename(sys.argv[0]) in ("fairseq-hydra-train", "hydra_train.py")


def in_launchers_terms(message: str) -> str:
    """``message``, which names fairseq-train's options, with how fairseq-hydra-train spells them when that
    launched this process."""
    if not launched_by_hydra():
        return message
    return (f"{message.rstrip('.')}. Under fairseq-hydra-train an option --some-option V named here is the key "
            "some_option=V of its group (model., task., checkpoint. ...: fairseq-hydra-train ... --cfg job lists "
            "them), a flag is its key set to true (--reset-optimizer: checkpoint.reset_optimizer=true), and a key of "
            "model., task., criterion., optimizer. or lr_scheduler. that the config file lacks takes a leading + "
            "(+model.lion_short_conv=4).")


def finished_run_message(filename: str, num_updates: int, cfg: Any) -> Optional[str]:
    """What to say where a LION run resumed from ``filename`` has already made ``--max-update`` updates; None
    where it has not. fairseq checks the count only after an update, so it trained one more and saved over
    checkpoint_last.pt and checkpoint_best.pt: a recipe run again changed its finished checkpoints."""
    max_update = getattr(cfg.optimization, "max_update", 0) or 0
    if not is_lion_config(cfg.model) or not 0 < max_update <= num_updates:
        return None
    return in_launchers_terms(
        f"{filename} is at {num_updates} updates and --max-update is {max_update}: this run has finished, so nothing "
        "is trained and no checkpoint is written (fairseq would train one update more and save over "
        "checkpoint_last.pt and checkpoint_best.pt). Raise --max-update to train on; for a new run, pass a new "
        "--save-dir")


def _wrap_trainer_load_checkpoint(original):
    """fairseq's trainer turns any load failure into 'please ensure that the architectures match', the last
    line a user reads: where the cause is this plugin's message, that message is raised last instead. A
    ``--restore-file`` that does not exist is refused where ``--reset-*`` options ask to start from it (and
    under fairseq-hydra-train where hydra's run folder hides it), a ``--finetune-from-model`` that is a folder
    or a file this run would save over is refused, an
    optimizer state of other parameters is refused naming ``--reset-optimizer``, and a run resumed (without
    ``--reset-optimizer``) as another model than its checkpoint was trained as (``FIXED_BY_TRAINING``) is
    refused naming the change; a new run from it logs the change. A LION run resumed at or past
    ``--max-update`` ends there, with status 0, instead of training an update more."""
    @functools.wraps(original)
    def load_checkpoint(self, filename, *args, **kwargs):
        refused = finetune_in_save_dir_message(self.cfg.checkpoint)
        if refused:
            raise CheckpointError(in_launchers_terms(refused))
        missing = missing_restore_file_message(filename, self.cfg.checkpoint)
        if missing:
            raise FileNotFoundError(in_launchers_terms(missing))
        try:
            extra_state = original(self, filename, *args, **kwargs)
        except Exception as e:
            cause = e.__cause__ or e.__context__
            if "architectures match" in str(e) and cause is not None and (
                    "do not fit the model being built" in str(cause) or isinstance(cause, ValueError)):
                from .check_checkpoint import softmax_start_options

                other = other_kind_message(filename, self.cfg.model)
                model = _TRAINED_AS.get(str(filename))
                trained = trained_as_options(model) if other is None else None
                # a softmax teacher's heads and structure, which its weights do not show, are in its config
                teacher = softmax_start_options({"cfg": {"model": model}}) if other is None and not trained \
                    and model is not None else None
                said = (f" It was trained as {trained}." if trained else
                        f" Its config gives LION-S of its kind as {teacher}." if teacher else "")
                raise CheckpointError(in_launchers_terms(f"cannot start from {filename}: {other or cause}{said}")
                                      ) from e
            if isinstance(e, ValueError) and str(e).startswith("loaded state dict"):  # torch's optimizer
                raise CheckpointError(in_launchers_terms(
                    f"cannot resume the optimizer of {filename}: it holds the state of another model's "
                    "parameters (another arch or other sizes, as a softmax checkpoint given to a LION model has). "
                    "To start a new run from its weights pass --reset-optimizer --reset-lr-scheduler "
                    "--reset-meters --reset-dataloader, or use --finetune-from-model")) from e
            raise
        trained = _TRAINED_AS.pop(str(filename), None)
        changes, teacher = changed_since_training(trained, self.cfg.model), not is_lion_config(trained)
        if self.data_parallel_world_size > 1:  # only rank 0 may have read the file: every rank stops alike
            from fairseq.distributed import utils as distributed_utils

            changes, teacher = distributed_utils.broadcast_object(
                (changes, teacher), src_rank=0, group=self.data_parallel_process_group, dist_device=self.device)
        if changes:
            reset_optimizer = args[0] if args else kwargs.get("reset_optimizer", False)
            if not reset_optimizer:  # the run goes on: nothing has trained yet, and the checkpoint is intact
                raise CheckpointError(in_launchers_terms(
                    f"cannot resume {filename}: it was trained as another model than this command builds "
                    f"({'; '.join(changes)}). No tensor changes shape, so the run would go on training another "
                    "model on its weights without a word. Pass the options the run was started with; to start the "
                    "changed model from these weights, pass --reset-optimizer --reset-lr-scheduler --reset-meters "
                    "--reset-dataloader (or --finetune-from-model) and a new --save-dir"))
            if written_by_this_run(filename, self.cfg.checkpoint):  # the new model would replace the run's files
                suffix = str(getattr(self.cfg.checkpoint, "checkpoint_suffix", "") or "")
                given = os.path.abspath(filename)  # as typed: fairseq adds --checkpoint-suffix to it again
                if suffix and given.endswith(suffix + ".pt"):
                    given = given[:-len(suffix + ".pt")] + ".pt"
                raise CheckpointError(in_launchers_terms(
                    f"cannot start another model from {filename}: it was trained as another model than this "
                    f"command builds ({'; '.join(changes)}), and it lies in --save-dir under a name this run "
                    "writes, so the changed model would save over that run's checkpoints. Pass a new --save-dir "
                    f"(with --restore-file {given} or --finetune-from-model); to resume the run, "
                    "pass the options it was started with"))
            if teacher:
                logger.warning(f"lion: starting from the softmax model {filename}, whose weights were trained with "
                               f"another structure than this model's: {'; '.join(changes)}. Pass the teacher's to "
                               "start from what it learned")
            else:
                logger.warning(f"lion: starting from {filename}, trained as another model than this one: "
                               f"{'; '.join(changes)}")
        finished = finished_run_message(filename, self.get_num_updates(), self.cfg)
        if finished:  # every rank holds the same count (rank 0's checkpoint, broadcast), so every rank ends here
            if self.data_parallel_rank == 0:
                logger.warning(finished)
            raise SystemExit(0)
        return extra_state
    load_checkpoint.__lion_wrapped__ = True
    return load_checkpoint


class ClearLoadErrors:
    """Mixin for LION models: a state dict of another architecture fails with :func:`load_error_message`
    (fairseq then adds its own 'please ensure that the architectures match')."""

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        try:
            return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)
        except RuntimeError as e:
            raise RuntimeError(load_error_message(self, state_dict, e)) from e


# ---- data that does not fit the model -------------------------------------------------------------------

def embed_tokens_checked(embed: torch.nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """``embed(tokens)``; a token id past the embedding table (binaries made with another, larger
    dictionary) fails with a message instead of torch's 'index out of range in self'. Costs nothing
    when the ids fit (the check runs only after the lookup failed)."""
    try:
        return embed(tokens)
    except IndexError as e:
        raise ValueError(
            f"token id {int(tokens.max())} is past the dictionary's {embed.num_embeddings} entries: the tokens were "
            "made with another (larger) dictionary than the dict.txt in the data folder (or than the checkpoint's). "
            "Binarise with fairseq-preprocess --srcdict <the dict.txt you train with> (python -m preprocess.text: "
            "--spm-model <its data-bin>/sentencepiece.bpe.model), or use the dict.txt written next to these .bin "
            "files; from Python, make token ids with the hub's encode() or its task's "
            "dictionary") from e


# what learned positions are, and how a model goes past their length: for every message that meets them
LEARNED_POSITIONS = "--lion-positions learned, LION-LIT's default"
PAST_LEARNED_POSITIONS = ("train with --lion-positions none, or LION-D / LION-S, which have no positions and no "
                          "length limit")


def check_learned_positions(longest: int, max_positions: int,
                            shorter: str = "shorter inputs (--tokens-per-sample, --max-positions, --truncate-sequence)",
                            set_by: str = "--max-positions / --tokens-per-sample") -> None:
    """Learned absolute positions (LION-LIT) stop at the training length; say so, and what to pass
    (``shorter``: how to shorten the input where it comes from; ``set_by``: the training options that set
    the number of positions)."""
    if longest > max_positions:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the {max_positions} learned positions of this model "
            f"({LEARNED_POSITIONS}; {set_by} at training): use {shorter}, or {PAST_LEARNED_POSITIONS}")
