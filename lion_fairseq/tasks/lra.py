"""Long Range Arena tasks: ``lra_listops``, ``lra_text``, ``lra_retrieval``, ``lra_image``,
``lra_pathfinder``, ``lra_pathx``.

Each reads the binaries that ``python -m preprocess.lra`` writes (``input0/``, ``input1/`` for
retrieval, ``label/``, ``lra.json``) and yields batches ``{"net_input": {"src_tokens": (B, T),
"src_lengths": (B,)[, "src_tokens_1": (B, T')]}, "target": (B,)}`` for a sequence classifier such as
``lion_lra`` with ``--criterion lion_classification``. Sequences carry no ``<s>``/``</s>``; batches are
right-padded and grouped by length. Image-like tasks also tell the model their grid
(``task.image_size``), which it needs for the snake orderings.

(fairseq has no built-in task of these names: registering them does not shadow one.)
"""
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np
from fairseq.data import (Dictionary, IdDataset, NestedDictionaryDataset, NumelDataset, NumSamplesDataset,
                          RawLabelDataset, RightPadDataset, SortDataset, TruncateDataset, data_utils)
from fairseq.dataclass import FairseqDataclass
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II, MISSING

logger = logging.getLogger(__name__)


@dataclass
class LRAConfig(FairseqDataclass):
    data: str = field(default=MISSING, metadata={"help": "folder written by python -m preprocess.lra"})
    num_classes: Optional[int] = field(default=None, metadata={"help": "classes (default: from lra.json)"})
    max_positions: Optional[int] = field(
        default=None, metadata={"help": "truncate inputs to this many tokens (default: lra.json's max_length)"})
    no_shuffle: bool = field(default=False, metadata={"help": "keep the data order (batches still grouped by length)"})
    seed: int = II("common.seed")


class LRATask(FairseqTask):
    """The common loader; subclasses fix the data kind and the number of inputs per example."""

    KIND = ""
    INPUTS = 1
    MIN_IMAGE_SIZE = 0  # Path-X refuses smaller images

    def __init__(self, cfg: LRAConfig, dictionary: Dictionary, meta: Dict[str, Any]):
        super().__init__(cfg)
        self.dictionary = dictionary
        self.num_classes = cfg.num_classes or meta["num_classes"]
        self._max_positions = cfg.max_positions or meta["max_length"]
        size = meta.get("image_size")
        channels = meta.get("channels", 1)
        # (height, width) of the token grid; RGB images put 3 tokens per pixel along each row
        self.image_size: Optional[Tuple[int, int]] = (size, size * channels) if size else None
        if self.image_size and self._max_positions < size * size * channels:
            raise ValueError(f"--max-positions {self._max_positions} would cut the {size}x{size} images "
                             f"({size * size * channels} tokens); the orderings need whole images")

    @classmethod
    def setup_task(cls, cfg: LRAConfig, **kwargs) -> "LRATask":
        meta_path = os.path.join(cfg.data, "lra.json")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{meta_path} not found: prepare the data with python -m preprocess.lra")
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("kind") != cls.KIND:
            raise ValueError(f"{cfg.data} holds LRA {meta.get('kind')!r} data; this task reads {cls.KIND!r}")
        if cls.MIN_IMAGE_SIZE and (meta.get("image_size") or 0) < cls.MIN_IMAGE_SIZE:
            raise ValueError(f"{cfg.data} holds {meta.get('image_size')}px images; Path-X is "
                             f"{cls.MIN_IMAGE_SIZE}x{cls.MIN_IMAGE_SIZE} (use lra_pathfinder for smaller ones)")
        dictionary = Dictionary.load(os.path.join(cfg.data, "input0", "dict.txt"))
        logger.info("LRA %s: %d classes, %d-symbol dictionary, max length %s, image %s", cls.KIND,
                    meta["num_classes"], len(dictionary), meta["max_length"], meta.get("image_size"))
        return cls(cfg, dictionary, meta)

    def _indexed(self, sub: str, split: str, dictionary: Optional[Dictionary]):
        path = os.path.join(self.cfg.data, sub, split)
        ds = data_utils.load_indexed_dataset(path, dictionary)
        if ds is None:
            raise FileNotFoundError(f"LRA {self.KIND}: no {split} data at {path}.{{bin,idx}}")
        return ds

    def load_dataset(self, split: str, combine: bool = False, epoch: int = 1, **kwargs) -> None:
        inputs = []
        for i in range(self.INPUTS):
            ds = self._indexed(f"input{i}", split, self.dictionary)
            if ds.sizes.max() > self._max_positions:
                ds = TruncateDataset(ds, self._max_positions)
            inputs.append(ds)
        label_ds = self._indexed("label", split, None)
        labels = np.fromiter((int(label_ds[i][0]) for i in range(len(label_ds))), dtype=np.int64,
                             count=len(label_ds))
        if len(labels) != len(inputs[0]):
            raise ValueError(f"LRA {self.KIND} {split}: {len(labels)} labels for {len(inputs[0])} inputs")
        if labels.max() >= self.num_classes:
            raise ValueError(f"LRA {self.KIND} {split}: label {labels.max()} with --num-classes {self.num_classes}")

        pad = self.dictionary.pad()
        net_input = {"src_tokens": RightPadDataset(inputs[0], pad_idx=pad),
                     "src_lengths": NumelDataset(inputs[0], reduce=False)}
        ntokens = NumelDataset(inputs[0], reduce=True)
        sizes = inputs[0].sizes
        if self.INPUTS == 2:
            net_input["src_tokens_1"] = RightPadDataset(inputs[1], pad_idx=pad)
            net_input["src_lengths_1"] = NumelDataset(inputs[1], reduce=False)
            sizes = np.maximum(sizes, inputs[1].sizes)
        dataset = NestedDictionaryDataset(
            {"id": IdDataset(), "net_input": net_input, "target": RawLabelDataset(labels.tolist()),
             "nsentences": NumSamplesDataset(), "ntokens": ntokens}, sizes=[sizes])
        with data_utils.numpy_seed(self.cfg.seed + epoch):
            shuffle = np.random.permutation(len(dataset))
        # length first, then the random order: batches of similar lengths (little padding), while
        # fairseq still shuffles the batches every epoch
        order = [shuffle, sizes] if not self.cfg.no_shuffle else [np.arange(len(dataset)), sizes]
        self.datasets[split] = SortDataset(dataset, sort_order=order)
        logger.info("LRA %s %s: %d examples", self.KIND, split, len(dataset))

    def build_model(self, cfg: Any, from_checkpoint: bool = False):
        from fairseq.models import ARCH_MODEL_NAME_REGISTRY

        arch = getattr(cfg, "_name", None) or getattr(cfg, "arch", None)
        if ARCH_MODEL_NAME_REGISTRY.get(arch) != "lion_lra":  # another model's output failed in the criterion
            raise ValueError(f"--arch {arch}: the lra_* tasks train a LION sequence classifier, an arch of lion_lra "
                             f"(lion_{{lit,d,s}}_lra_{{{self.KIND},small,tiny}}, ...)")
        return super().build_model(cfg, from_checkpoint)

    def build_criterion(self, cfg: Any, from_checkpoint: bool = False):
        name = getattr(cfg, "_name", None)
        if name != "lion_classification":  # fairseq's default, cross_entropy, trained on without a word
            raise ValueError(f"--criterion {name}: the lra_* tasks train and validate with --criterion "
                             "lion_classification (cross-entropy over the classes, and their accuracy): pass that")
        return super().build_criterion(cfg, from_checkpoint)

    def get_batch_iterator(self, dataset, *args, **kwargs):
        # fairseq's compiled batch_by_size here drops the last examples that do not fill a multiple of
        # --required-batch-size-multiple (8 by default): 2 of 10 test examples would go uncounted.
        # Accuracy must see every example, and LRA gains nothing from multiples of 8.
        kwargs["required_batch_size_multiple"] = 1
        return super().get_batch_iterator(dataset, *args, **kwargs)

    def max_positions(self) -> int:
        return self._max_positions

    @property
    def source_dictionary(self) -> Dictionary:
        return self.dictionary

    @property
    def target_dictionary(self) -> None:
        return None


# one config class per task: fairseq stores each task's config node under its own name
@dataclass
class LRAListOpsConfig(LRAConfig):
    pass


@dataclass
class LRATextConfig(LRAConfig):
    pass


@dataclass
class LRARetrievalConfig(LRAConfig):
    pass


@dataclass
class LRAImageConfig(LRAConfig):
    pass


@dataclass
class LRAPathfinderConfig(LRAConfig):
    pass


@dataclass
class LRAPathXConfig(LRAConfig):
    pass


@register_task("lra_listops", dataclass=LRAListOpsConfig)
class LRAListOpsTask(LRATask):
    """ListOps: nested MIN/MAX/MED/SM expressions up to 2000 tokens, 10 classes."""
    KIND = "listops"


@register_task("lra_text", dataclass=LRATextConfig)
class LRATextTask(LRATask):
    """IMDB sentiment, byte level, up to 4096 bytes, 2 classes."""
    KIND = "text"


@register_task("lra_retrieval", dataclass=LRARetrievalConfig)
class LRARetrievalTask(LRATask):
    """ACL Anthology citation matching: two byte-level documents (``src_tokens``, ``src_tokens_1``),
    each encoded on its own by the shared encoder, 2 classes."""
    KIND = "retrieval"
    INPUTS = 2


@register_task("lra_image", dataclass=LRAImageConfig)
class LRAImageTask(LRATask):
    """CIFAR-10 as a sequence of 1024 grayscale pixels (row-major), 10 classes."""
    KIND = "image"


@register_task("lra_pathfinder", dataclass=LRAPathfinderConfig)
class LRAPathfinderTask(LRATask):
    """Pathfinder: are the two markers joined by one dashed curve? 32x32 pixels (any size), 2 classes."""
    KIND = "pathfinder"


@register_task("lra_pathx", dataclass=LRAPathXConfig)
class LRAPathXTask(LRATask):
    """Path-X: Pathfinder at 128x128 (16384 pixels), 2 classes."""
    KIND = "pathfinder"
    MIN_IMAGE_SIZE = 128


