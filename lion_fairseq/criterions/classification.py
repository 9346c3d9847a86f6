"""``lion_classification``: cross-entropy over whole-sequence classes, reporting accuracy.

For models that return class logits ``(B, num_classes)`` from ``model(**sample["net_input"])`` (the
``lion_lra`` classifier). fairseq's ``sentence_prediction`` criterion needs RoBERTa-style named
classification heads, hence this one. Logged: ``loss`` (base 2, per sequence, like fairseq's other
criteria), ``accuracy`` (percent) and ``examples`` (how many it was computed on), so ``--best-checkpoint-metric accuracy
--maximize-best-checkpoint-metric`` keeps the most accurate checkpoint.
"""
import math
from dataclasses import dataclass

import torch.nn.functional as F
from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass


@dataclass
class LionClassificationConfig(FairseqDataclass):
    pass


@register_criterion("lion_classification", dataclass=LionClassificationConfig)
class LionClassificationCriterion(FairseqCriterion):
    def forward(self, model, sample, reduce: bool = True):
        """Returns (loss summed over the batch, sample size = sequences, logging dict)."""
        logits = model(**sample["net_input"])
        targets = sample["target"].view(-1)
        loss = F.cross_entropy(logits.float(), targets, reduction="sum" if reduce else "none")
        n = targets.numel()
        ntokens = sample["ntokens"]
        if "src_lengths_1" in sample["net_input"]:  # a pair task's second document is read too (wps, wpb)
            ntokens = ntokens + sample["net_input"]["src_lengths_1"].sum().data
        logging_output = {"loss": loss.data, "ntokens": ntokens, "nsentences": n, "sample_size": n,
                          "ncorrect": (logits.argmax(-1) == targets).sum().data}
        return loss, n, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        loss = sum(log.get("loss", 0) for log in logging_outputs)
        n = sum(log.get("sample_size", 0) for log in logging_outputs)
        ncorrect = sum(log.get("ncorrect", 0) for log in logging_outputs)
        metrics.log_scalar("loss", loss / max(n, 1) / math.log(2), n, round=3)
        metrics.log_scalar("accuracy", 100.0 * ncorrect / max(n, 1), n, round=2)
        # a number, as fairseq's criterions log it (a pair task's sum is a tensor: its log showed 1013.4000244)
        metrics.log_scalar("ntokens", utils.item(sum(log.get("ntokens", 0) for log in logging_outputs)))
        metrics.log_scalar("nsentences", n)
        # a count, not a per-batch average: how many examples the accuracy above was computed on
        metrics.log_scalar_sum("examples", n)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
