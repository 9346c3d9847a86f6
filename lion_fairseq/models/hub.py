"""The hub's tokenisation from the data: fairseq's ``from_pretrained`` runs a BPE only when one is passed
(``bpe=``) or the checkpoint names one (``--bpe``); otherwise it splits on whitespace, silently, and
sentencepiece-encoded data then reads as mostly ``<unk>``. ``preprocess.text`` writes its sentencepiece
model into the data folder as ``sentencepiece.bpe.model`` (fairseq's released tarballs keep it beside the
checkpoint): the hubs of the LION models use it when nothing else was asked for, and say so when there is
none."""
import argparse
import difflib
import logging
import numbers
import os
import re
import warnings
from collections import defaultdict
from typing import Dict, Iterable, Iterator, List, Optional

import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.hub_utils import GeneratorHubInterface

logger = logging.getLogger(__name__)

SPM = "sentencepiece.bpe.model"


def data_sentencepiece(folders: Iterable[Optional[str]]) -> Optional[str]:
    """The first ``sentencepiece.bpe.model`` in ``folders`` (the data's, the checkpoint's), or None."""
    for folder in folders:
        if folder and os.path.isfile(os.path.join(folder, SPM)):
            return os.path.join(folder, SPM)
    return None


def sentencepiece_bpe(path: str):
    from fairseq.data import encoders

    return encoders.build_bpe(argparse.Namespace(bpe="sentencepiece", sentencepiece_model=path))


def bpe_from_data(hub, folders: Iterable[Optional[str]]) -> None:
    """Give ``hub`` (a fairseq hub interface whose ``bpe`` is None) the data's sentencepiece model, or warn
    that its inputs are split on whitespace."""
    if hub.bpe is not None:
        return
    path = data_sentencepiece(folders)
    if path is not None:
        hub.bpe = sentencepiece_bpe(path)
        logger.info(f"hub: encoding with the data's sentencepiece model {path}")
        return
    warnings.warn(f"hub: no BPE was passed or named by the checkpoint, and there is no {SPM} in "
                  f"{' or '.join(f for f in folders if f)}: inputs are split on whitespace into dictionary "
                  "entries (right for word-level data; for BPE data pass bpe=..., e.g. bpe='sentencepiece', "
                  "sentencepiece_model=..., bpe='gpt2' for a model started from roberta.base, or "
                  "bpe='subword_nmt', bpe_codes=... for subword-nmt data such as fairseq's IWSLT'14)", stacklevel=3)


def generation_keywords_message(unknown: Iterable[str], known: Iterable[str]) -> str:
    """Why ``unknown`` keywords of ``generate``/``sample``/``translate`` are refused, with the option each is
    a near miss of."""
    known = sorted(known)
    named = []
    for key in sorted(unknown):
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.7)  # 0.7: 'beem' finds 'beam' (0.75)
        if key.startswith("lion_"):  # a model option: the model is built with it, not the generator
            why = "a model option: pass it to from_pretrained (lion_form and lion_chunk_size switch on a trained model)"
        else:
            why = "did you mean " + repr(near[0]) if near else "not a generation option"
        named.append(f"{key!r} ({why})")
    seed = " (sampling repeats under torch.manual_seed)" if "seed" in unknown else ""
    return (f"{', '.join(named)}: fairseq would set it on the generation config, where nothing reads it, and "
            f"generate as if it were not passed{seed}. The keywords are fairseq-generate's options without the "
            "dashes, with underscores (--sampling-topk -> sampling_topk)")


class CheckedGeneratorHubInterface(GeneratorHubInterface):
    """fairseq's ``GeneratorHubInterface`` (``sample``, ``translate``, ``generate``), refusing a keyword that
    is no generation option (``temprature=0.5``, ``seed=7``), which fairseq accepts and ignores, and saying
    what to do with a text past the model's length limit in the hub's terms (fairseq's own message names a
    command-line option)."""

    def generate(self, tokenized_sentences: List[torch.LongTensor], beam: int = 5, verbose: bool = False,
                 skip_invalid_size_inputs: bool = False, inference_step_args=None, prefix_allowed_tokens_fn=None,
                 **kwargs) -> List[List[Dict[str, torch.Tensor]]]:
        options = self.cfg.generation
        unknown = set(kwargs) - set(options.keys()) if hasattr(options, "keys") else set()
        if unknown:
            raise ValueError(generation_keywords_message(unknown, options.keys()))
        if not (isinstance(beam, numbers.Integral) and beam >= 1):  # fairseq: "cannot reshape tensor of 0 elements"
            raise ValueError(f"beam={beam!r}: the number of hypotheses kept must be an integer >= 1 (1: greedy or, "
                             "with sampling=True, one sample)")
        try:
            return super().generate(tokenized_sentences, beam, verbose, skip_invalid_size_inputs, inference_step_args,
                                    prefix_allowed_tokens_fn, **kwargs)
        except Exception as e:
            found = re.match(r"Size of sample #\d+ is invalid .* since max_positions=(.*), skip", str(e))
            if found is None:
                raise
            longest = max(len(t) for t in tokenized_sentences)
            raise ValueError(f"a text of {longest} tokens is past this model's max_positions {found.group(1)}: "
                             "use a shorter text (or, among a list of texts, skip_invalid_size_inputs=True to leave "
                             "it out of the results); positions without weights (fairseq's sinusoidal ones) go further "
                             "when from_pretrained is given larger max_source_positions / max_target_positions") from e

    def _build_batches(self, tokens: List[torch.Tensor], skip_invalid_size_inputs: bool) -> Iterator:
        """fairseq's batches, under a ``max_tokens`` (the training run's ``--max-tokens``, kept in the checkpoint)
        raised to the longest text: it sizes batches, and fairseq stopped on one text longer than it
        (``Sentences lengths should not exceed max_tokens``), though LION-D/S take any length."""
        limit = self.cfg.dataset.max_tokens
        longest = max((len(t) for t in tokens), default=0)
        if limit is None or longest <= limit:
            return super()._build_batches(tokens, skip_invalid_size_inputs)
        # fairseq's own body with the raised limit: the config, shared by every call, is left as it is
        return self.task.get_batch_iterator(
            dataset=self.task.build_dataset_for_inference(tokens, torch.LongTensor([len(t) for t in tokens])),
            max_tokens=longest, max_sentences=self.cfg.dataset.batch_size, max_positions=self.max_positions,
            ignore_invalid_inputs=skip_invalid_size_inputs, disable_iterator_cache=True).next_epoch_itr(shuffle=False)

    def score(self, sentences, replace_newline_with_eos: bool = False, **kwargs):
        """fairseq's, which scores a language model's text; on a translation model it has no target to score
        (fairseq's own fails inside the model, missing prev_output_tokens): refused, naming what does."""
        if getattr(self.task, "src_dict", None) is not None:  # a translation task's (a language model's has none)
            raise ValueError("score() scores a language model's text; a translation model scores a target given its "
                             "source with fairseq-generate --score-reference (a reference translation per source "
                             "sentence), or through the model's forward with prev_output_tokens")
        return super().score(sentences, replace_newline_with_eos, **kwargs)


class ContinuationHubInterface(CheckedGeneratorHubInterface):
    """fairseq's ``GeneratorHubInterface`` for a language model, with lengths counted after the prompt:
    ``sample(prompt, max_len_b=N)`` continues each prompt by up to ``max_len_a * len(prompt) + N`` tokens,
    and ``min_len`` counts new tokens too. fairseq's own counts the prompt in, so a prompt longer than N
    came back cut to its first N tokens with nothing generated.

    The generator's length limit is one number per batch, so prompts are generated in groups of one
    length (each group still one batch of fairseq's). Learned positions (LION-LIT's) bound prompt and
    continuation together: a longer prompt is refused (or skipped with ``skip_invalid_size_inputs``), and
    a continuation that would run past them warns that it stops there."""

    def generate(self, tokenized_sentences: List[torch.LongTensor], beam: int = 5, verbose: bool = False,
                 skip_invalid_size_inputs: bool = False, inference_step_args=None, prefix_allowed_tokens_fn=None,
                 **kwargs) -> List[List[Dict[str, torch.Tensor]]]:
        if torch.is_tensor(tokenized_sentences) and tokenized_sentences.dim() == 1:
            return self.generate(tokenized_sentences.unsqueeze(0), beam, verbose, skip_invalid_size_inputs,
                                 inference_step_args, prefix_allowed_tokens_fn, **kwargs)[0]
        # bounded by learned positions, or by --max-target-positions: say which
        limit, (bound, beyond) = min((m.max_positions(), m.decoder.length_bound) for m in self.models)
        if kwargs.get("score_reference"):  # score(): nothing follows the text, which fits if its tokens do
            if not skip_invalid_size_inputs and len(tokenized_sentences):
                # fairseq's own refusal names a command-line option (--skip-invalid-size-inputs-valid-test)
                longest = max(len(t) for t in tokenized_sentences)
                if longest > limit:
                    raise ValueError(f"a sequence of {longest} tokens exceeds this model's {limit} {bound}: use a "
                                     "shorter text (or, among a list of texts, skip_invalid_size_inputs=True to leave "
                                     f"it out of the results), or {beyond}")
            return super().generate(tokenized_sentences, beam, verbose, skip_invalid_size_inputs, inference_step_args,
                                    prefix_allowed_tokens_fn, **kwargs)
        # fairseq's default length (max_len_b 200) runs into them unasked; one asked for here or at loading is said
        asked = "max_len_a" in kwargs or "max_len_b" in kwargs or (
            self.cfg.generation.max_len_a, self.cfg.generation.max_len_b) != (GenerationConfig.max_len_a,
                                                                              GenerationConfig.max_len_b)
        per_prompt = kwargs.pop("max_len_a", self.cfg.generation.max_len_a)
        new = kwargs.pop("max_len_b", self.cfg.generation.max_len_b)
        min_new = kwargs.pop("min_len", self.cfg.generation.min_len)
        eos = self.task.source_dictionary.eos()
        groups: Dict[int, List[int]] = defaultdict(list)
        for i, tokens in enumerate(tokenized_sentences):
            # encode() ends a prompt with </s>, which the task strips before it becomes the prefix
            groups[len(tokens) - int(len(tokens) > 0 and tokens[-1] == eos)].append(i)
        outputs: List[Optional[List[Dict[str, torch.Tensor]]]] = [None] * len(tokenized_sentences)
        room = limit - 1  # tokens of prompt and continuation: the generator keeps the last position for </s>
        for prompt, ids in groups.items():
            if prompt >= room:  # not one token to add
                if skip_invalid_size_inputs:
                    continue
                raise ValueError(
                    f"a prompt of {prompt} tokens leaves no room to continue in this model's {limit} {bound} (the "
                    f"generator keeps the last for </s>): use a prompt of at most {room - 1} tokens (or, among a list "
                    f"of prompts, skip_invalid_size_inputs=True to leave it out of the results), or {beyond}")
            wanted, least = int(per_prompt * prompt + new), min_new
            if least > wanted:  # fairseq: "min_len cannot be larger than max_len", in its own prompt-counting terms
                raise ValueError(f"min_len={least} new tokens is more than the {wanted} that max_len_b={new} (and "
                                 f"max_len_a={per_prompt}) allow after a prompt of {prompt} tokens: lower min_len or "
                                 "raise max_len_b (both count new tokens; min_len is 1 unless given)")
            if prompt + wanted > room:
                if asked:
                    warnings.warn(f"a prompt of {prompt} tokens continues by at most {room - prompt} tokens, not "
                                  f"{wanted}: the model's {limit} {bound} bound prompt and continuation together")
                least = min(least, room - prompt)
            hypos = super().generate([tokenized_sentences[i] for i in ids], beam, verbose, skip_invalid_size_inputs,
                                     inference_step_args, prefix_allowed_tokens_fn, max_len_a=0,
                                     max_len_b=prompt + wanted, min_len=prompt + least,
                                     **kwargs)
            # a group is skipped whole or not at all (skip_invalid_size_inputs goes by length)
            for i, h in zip(ids, hypos):
                outputs[i] = h
        return [h for h in outputs if h is not None]


def load_pretrained(cls, model_name_or_path: str, checkpoint_file: str, data_name_or_path: str,
                    **kwargs) -> Dict:
    """fairseq's ``hub_utils.from_pretrained`` for ``cls`` (``{"args", "task", "models"}``), with a clear
    error where fairseq gives a ``TypeError`` (a folder that does not exist) or where the checkpoint holds
    another kind of model than ``cls`` (it would build that model and run it through ``cls``'s hub: an LM's
    continuation returned as a translation, say)."""
    from fairseq import hub_utils

    where = f"{cls.__name__}.from_pretrained"
    if os.path.isfile(model_name_or_path):
        raise ValueError(f"{where}: {model_name_or_path} is a checkpoint file; pass its folder and its name, "
                         f"from_pretrained({os.path.dirname(model_name_or_path) or '.'!r}, "
                         f"{os.path.basename(model_name_or_path)!r}, <data folder>)")
    # fairseq reads a data path that starts with "." inside the checkpoint's folder
    data = (os.path.join(model_name_or_path, data_name_or_path) if str(data_name_or_path).startswith(".")
            else data_name_or_path)
    # a "./data" meant from the current folder: the data entry says where fairseq looked instead
    here = (f" (fairseq reads a data path that starts with '.' inside the checkpoint's folder; from the current "
            f"folder, pass {os.path.abspath(data_name_or_path)!r})"
            if data != data_name_or_path and os.path.isdir(data_name_or_path) else "")
    for path, what, hint in ((model_name_or_path, "the checkpoint's folder", ""), (data, "the data folder", here)):
        if path and "://" not in str(path) and path not in cls.hub_models() and not os.path.exists(path):
            raise FileNotFoundError(f"{where}: {what} {path} does not exist{hint}")
    if os.path.isdir(model_name_or_path):
        missing = [f for f in checkpoint_file.split(os.pathsep)  # fairseq's ensembles: a.pt:b.pt
                   if not os.path.isfile(os.path.join(model_name_or_path, f))]
        if missing:
            found = sorted(f for f in os.listdir(model_name_or_path) if f.endswith(".pt"))
            raise FileNotFoundError(f"{where}: no checkpoint {missing[0]!r} in {model_name_or_path} (the second "
                                    f"argument, checkpoint_file); there: {', '.join(found) or 'no .pt files'}")
    bpe = kwargs.get("bpe")
    if bpe is not None:
        from fairseq.registry import REGISTRIES

        known = sorted(REGISTRIES["bpe"]["registry"])
        if bpe not in known:  # fairseq: a bare KeyError of the name
            near = difflib.get_close_matches(str(bpe), known, n=1)
            raise ValueError(f"{where}: bpe={bpe!r} is no BPE fairseq knows"
                             + (f": did you mean {near[0]!r}?" if near else "") + f" (fairseq's: {', '.join(known)})")
    if bpe == "sentencepiece" and not kwargs.get("sentencepiece_model"):
        # fairseq looks for the model beside the checkpoint only, and stops at omegaconf's "Missing mandatory value"
        kwargs["sentencepiece_model"] = data_sentencepiece([data, model_name_or_path])
        if kwargs["sentencepiece_model"] is None:
            raise FileNotFoundError(f"{where}: bpe='sentencepiece' needs its model, and there is no {SPM} in the data "
                                    f"folder {data} or beside the checkpoint: pass sentencepiece_model=<its path>")
    try:
        x = hub_utils.from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path,
                                      archive_map=cls.hub_models(), **kwargs)
    except Exception as e:
        missing = missing_dictionary(e)
        if missing is None:
            raise
        raise FileNotFoundError(
            f"{cls.__name__}.from_pretrained: the data folder {os.path.normpath(data)} has no {missing}: pass the "
            "folder of the data the model was trained on (its data-bin, or a folder with its dictionaries) as the "
            "third argument, data_name_or_path (default '.', the checkpoint's folder)") from e
    model = x["models"][0]
    if not isinstance(model, cls):
        found = type(model).__name__
        name = getattr(getattr(x["args"], "model", None), "_name", "?")
        if found == "LionLRAModel":  # a classifier with no hub of its own (fairseq's generic one cannot classify)
            fix = ("an LRA classifier: fairseq-validate DATA --task lra_<its task> --path CHECKPOINT gives its accuracy; "
                   "in Python, fairseq's checkpoint_utils.load_model_ensemble([CHECKPOINT]) (after import lion_fairseq) "
                   "gives the model, whose forward(src_tokens, src_lengths) returns the class logits")
        elif type(model).__module__.startswith("lion_fairseq"):
            fix = f"load it with {found}.from_pretrained"
        else:
            fix = "it is not a LION model: python -m lion_fairseq.convert makes one from a softmax checkpoint"
        raise TypeError(f"{cls.__name__}.from_pretrained: {os.path.join(model_name_or_path, checkpoint_file)} holds "
                        f"a {found} (model {name!r}), not a {cls.__name__}: {fix}")
    return x


def missing_dictionary(error: BaseException) -> Optional[str]:
    """The dictionary that fairseq's task set-up did not find, from its error (None: another error)."""
    if isinstance(error, FileNotFoundError):
        # sentence_prediction reads input0/dict.txt (and label/dict.txt), the others dict[.lang].txt
        found = re.search(r"((?:input\d+|label)[/\\])?dict(\.[^/\\]+)?\.txt", str(error))
        return found.group(0) if found else None
    if "Could not infer language pair" in str(error):  # translation: neither languages nor data files
        return "dict.<source>.txt and dict.<target>.txt (nor data files naming the languages)"
    return None


class DataBpeHub:
    """Mixin for fairseq models whose ``from_pretrained`` gives a ``GeneratorHubInterface``
    (``sample``/``generate``, ``translate``; the class in ``hub_interface``): with no BPE passed or named by
    the checkpoint, the data's ``sentencepiece.bpe.model`` encodes the inputs (``bpe_from_data``)."""

    hub_interface = CheckedGeneratorHubInterface

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, checkpoint_file: str = "model.pt",
                        data_name_or_path: str = ".", **kwargs) -> GeneratorHubInterface:
        x = load_pretrained(cls, model_name_or_path, checkpoint_file, data_name_or_path, **kwargs)
        hub = cls.hub_interface(x["args"], x["task"], x["models"])
        bpe_from_data(hub, [getattr(hub.cfg.task, "data", None), model_name_or_path])
        return hub
