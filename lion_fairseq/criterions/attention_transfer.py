"""``lion_attention_transfer``: train a LION encoder's attention to reproduce a softmax teacher's, layer by
layer (Hedgehog's and LoLCATs' "attention transfer"), before ordinary training.

The teacher is a softmax RoBERTa checkpoint (``--teacher``, frozen, outside the model and its
checkpoints). For each batch it runs on the batch; at every layer its self-attention's input ``x_l``
(``T x B x C``) and output ``a_l`` (after the output projection) are taken, and the student's LION
attention of the same layer is run on the teacher's ``x_l``:

    loss = mean over layers of mean over real tokens and channels of (LionAttn_l(x_l) - a_l)^2

so each layer learns from the teacher's inputs, not from what earlier student layers make of them. Only
the parts of each LION attention named by ``--transfer-params`` get gradients (by default q and k
projections and the gates: how tokens mix, not what they carry); everything else, the rest of the
attention included, gets none and stays as it is. Logged: ``loss`` and ``rel_err``, the share of the
teacher's attention output not reproduced (``sum |s - a|^2 / sum |a|^2`` over layers and tokens).

Start the student from the teacher (``--finetune-from-model`` the same checkpoint, models/convert.py),
then train as usual from the transfer's checkpoint. With ``--fp16`` fairseq's optimizer steps every
parameter with a zero gradient: keep ``--weight-decay 0`` (its default) so that nothing else moves."""
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from fairseq import metrics
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from omegaconf import II
from torch import Tensor, nn

PARTS = {"q_proj": ("q_proj.",), "k_proj": ("k_proj.",), "v_proj": ("v_proj.",), "out_proj": ("out_proj.",),
         "gate": ("gate_logit", "gate_proj."), "conv": ("conv_weight",), "out_gate": ("out_gate.",),
         "head_norm": ("head_norm.",)}


@dataclass
class LionAttentionTransferConfig(FairseqDataclass):
    teacher: Optional[str] = field(default=None, metadata={"help": "the softmax RoBERTa checkpoint to reproduce"})
    transfer_params: str = field(
        default="q_proj,k_proj,gate",
        metadata={"help": f"comma-separated parts of each LION attention that train: {', '.join(PARTS)}"})
    ddp_backend: str = II("distributed_training.ddp_backend")
    distributed_world_size: int = II("distributed_training.distributed_world_size")


# the --ddp-backend values that average gradients after the backward, whatever ran in the forward
EXPLICIT_REDUCTION = ("legacy_ddp", "no_c10d")


def check_ddp_backend(ddp_backend: str, world_size: int) -> None:
    """The criterion runs the student's layers itself, not through the model's forward: torch's
    DistributedDataParallel (--ddp-backend pytorch_ddp, fairseq's default, and c10d) averages only the
    gradients of what its forward ran, so each process would train on its own batches without a word (and
    the sharding and SlowMo backends expect the forward too)."""
    if world_size > 1 and ddp_backend not in EXPLICIT_REDUCTION:
        raise ValueError(f"--criterion lion_attention_transfer with {world_size} processes needs --ddp-backend "
                         f"legacy_ddp (or no_c10d): it runs the student's layers outside the model's forward, "
                         f"which --ddp-backend {ddp_backend} needs to average their gradients across processes")


def trained_parts(spec: str) -> List[str]:
    """Parameter-name prefixes of ``--transfer-params``; an unknown part is refused, naming the option."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise ValueError(f"--transfer-params takes a comma-separated list of {', '.join(PARTS)}; got {spec!r}")
    return [prefix for n in names for prefix in PARTS[n]]


def check_teacher(path: str) -> None:
    """``--teacher`` must hold a softmax RoBERTa: a LION checkpoint would train the student towards another
    LION, and other kinds fail deep in fairseq's loading."""
    from ..clear_errors import load_checkpoint_file
    from ..convert import teacher_config, trained_model

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--teacher {path} does not exist: pass the softmax RoBERTa checkpoint")
    arch, kind = trained_model(teacher_config(load_checkpoint_file(path)))
    if kind != "roberta":
        raise ValueError(f"--teacher {path} holds a {kind or 'model of unknown kind'} (--arch {arch}), not a softmax "
                         "RoBERTa: attention transfer trains a LION encoder (--task masked_lm) towards a fairseq "
                         "roberta checkpoint; a causal LM or translation model starts from its softmax checkpoint "
                         "with --finetune-from-model instead")


@register_criterion("lion_attention_transfer", dataclass=LionAttentionTransferConfig)
class LionAttentionTransferCriterion(FairseqCriterion):
    def __init__(self, task, teacher: Optional[str] = None, transfer_params: str = "q_proj,k_proj,gate",
                 ddp_backend: str = "pytorch_ddp", distributed_world_size: int = 1):
        super().__init__(task)
        if not teacher:
            raise ValueError("--criterion lion_attention_transfer needs --teacher <the softmax RoBERTa checkpoint>")
        self.trained = trained_parts(transfer_params)
        check_ddp_backend(ddp_backend, distributed_world_size)
        from fairseq import checkpoint_utils

        check_teacher(teacher)
        models, _ = checkpoint_utils.load_model_ensemble([teacher], task=task)
        # a list, not a submodule: the teacher stays out of the optimizer and of every checkpoint
        self._teacher = [models[0].eval().requires_grad_(False)]
        self._checked_start = False

    def _check_start(self, layers, teacher_layers) -> None:
        """The parts outside ``--transfer-params`` stay frozen, so they must be the teacher's: a student
        that did not start from the teacher only reproduces it through random values and outputs."""
        for name in ("v_proj", "out_proj"):
            if any(prefix.startswith(name) for prefix in self.trained):
                continue
            mine = getattr(layers[0].self_attn, name).weight.detach().float()
            theirs = getattr(teacher_layers[0].self_attn, name).weight.detach().float().to(mine.device)
            if mine.shape != theirs.shape or (mine - theirs).norm() > 1e-3 * theirs.norm():
                raise ValueError(
                    f"the student's attention did not start from the teacher (layer 0's {name} differs), and "
                    f"what --transfer-params leaves out ({name} among it) stays frozen: pass --finetune-from-model "
                    "<the --teacher checkpoint> (or --restore-file <a converted checkpoint> with the --reset-* "
                    "options) so that the student starts as the teacher converted")
        self._checked_start = True

    def _teacher_states(self, src_tokens: Tensor, like: Tensor):
        """The teacher's per-layer (attention input, attention output), each ``(T, B, C)``."""
        teacher = self._teacher[0]
        if next(teacher.parameters()).device != like.device or next(teacher.parameters()).dtype != like.dtype:
            teacher.to(device=like.device, dtype=like.dtype)
        captured = []

        def hook(module, args, kwargs, output):
            x = kwargs.get("query", args[0] if args else None)
            captured.append((x.detach(), output[0].detach()))

        handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True)
                   for layer in teacher.encoder.sentence_encoder.layers]
        try:
            with torch.no_grad():
                teacher(src_tokens, features_only=True)
        finally:
            for h in handles:
                h.remove()
        return captured

    def forward(self, model: nn.Module, sample: Dict, reduce: bool = True):
        src = sample["net_input"]["src_tokens"]
        layers = model.encoder.sentence_encoder.every_layer()  # each paired with its teacher layer, under LayerDrop too
        states = self._teacher_states(src, next(model.parameters()))
        if len(states) != len(layers):
            raise ValueError(f"the teacher has {len(states)} layers and the model {len(layers)}: "
                             "pass the teacher's --encoder-layers")
        if states[0][0].shape[-1] != layers[0].self_attn.embed_dim:
            raise ValueError(f"the teacher is {states[0][0].shape[-1]} wide and the model "
                             f"{layers[0].self_attn.embed_dim}: pass the teacher's --encoder-embed-dim")
        if not self._checked_start:
            self._check_start(layers, self._teacher[0].encoder.sentence_encoder.layers)
        pad = src.eq(self.padding_idx)
        real = (~pad).t().unsqueeze(-1).to(states[0][1].dtype)  # (T, B, 1)
        tokens = real.sum() * states[0][1].shape[-1]
        loss, num, den = 0.0, 0.0, 0.0
        for layer, (x, target) in zip(layers, states):
            attn = layer.self_attn
            fixed = {n: p.detach() for n, p in attn.named_parameters() if not n.startswith(tuple(self.trained))}
            out = torch.func.functional_call(attn, fixed, (x,), {"key_padding_mask": pad if pad.any() else None})
            err = ((out.float() - target.float()) ** 2 * real).sum()
            loss = loss + err / tokens
            num = num + err.detach()
            den = den + (target.float() ** 2 * real).sum()
        loss = loss / len(layers)
        logging_output = {"loss": loss.data, "ntokens": sample["ntokens"], "nsentences": src.size(0),
                          "sample_size": 1, "rel_num": num, "rel_den": den}
        return loss, 1, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        n = sum(log.get("sample_size", 0) for log in logging_outputs)
        metrics.log_scalar("loss", sum(log.get("loss", 0) for log in logging_outputs) / max(n, 1), n, round=5)
        num = sum(log.get("rel_num", 0) for log in logging_outputs)
        den = sum(log.get("rel_den", 0) for log in logging_outputs)
        metrics.log_scalar("rel_err", float(num) / max(float(den), 1e-30), n, round=6)
        metrics.log_scalar("ntokens", sum(log.get("ntokens", 0) for log in logging_outputs))
        metrics.log_scalar("nsentences", sum(log.get("nsentences", 0) for log in logging_outputs))

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
