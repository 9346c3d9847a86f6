"""``python -m lion_fairseq.convert IN OUT --arch lion_s [options]``: a softmax RoBERTa checkpoint (e.g.
``roberta.base/model.pt``) written as a LION encoder's (``models/convert.py`` says what is copied, dropped
and added), loadable by the hub (``LionRobertaModel.from_pretrained``), ``--restore-file`` and
``--finetune-from-model``, with a dataclass config (so it reloads under torch's ``weights_only``).

The teacher's sizes (layers, width, FFN, heads, positions) are taken from the checkpoint unless given;
``--data`` is the folder of the teacher's ``dict.txt`` (default: the checkpoint's own folder, as in
fairseq's released tarballs). Any other fairseq option of the arch may follow (``--lion-*``, ...)."""
import argparse
import os
import sys
from typing import List, Optional

import torch

from .clear_errors import PACKAGE_DIR, _safe_load

SIZE_FLAGS = {"encoder_layers": "--encoder-layers", "encoder_embed_dim": "--encoder-embed-dim",
              "encoder_ffn_embed_dim": "--encoder-ffn-embed-dim", "encoder_attention_heads": "--encoder-attention-heads",
              "max_positions": "--max-positions"}


def convert(checkpoint: str, out: str, arch: str, data: Optional[str] = None, extra: Optional[List[str]] = None):
    """Writes the converted checkpoint to ``out``; returns the LION model (in eval mode)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    from .models.convert import teacher_sizes

    extra = list(extra or [])
    state = _safe_load(checkpoint)
    data = data or os.path.dirname(os.path.abspath(checkpoint))
    if not os.path.isfile(os.path.join(data, "dict.txt")):
        raise FileNotFoundError(f"no dict.txt in {data}: pass --data <the folder of the teacher's dict.txt>")
    sizes = teacher_sizes(state)
    flags = []
    for key, flag in SIZE_FLAGS.items():
        if sizes.get(key) is not None and flag not in extra:
            flags += [flag, str(sizes[key])]
    if sizes.get("max_positions") is not None and "--tokens-per-sample" not in extra:
        flags += ["--tokens-per-sample", str(sizes["max_positions"])]
    parser = options.get_training_parser()
    ns = options.parse_args_and_arch(parser, [data, "--user-dir", PACKAGE_DIR, "--task", "masked_lm", "--arch", arch,
                                              "--criterion", "masked_lm", "--load-checkpoint-heads", *flags, *extra])
    cfg = convert_namespace_to_omegaconf(ns)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)  # converts (upgrade_state_dict_named)
    torch.save({"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "args": None,
                "model": model.state_dict(), "criterion": None,
                "optimizer_history": [{"criterion_name": "MaskedLmLoss", "optimizer_name": "none",
                                       "lr_scheduler_state": {}, "num_updates": 0}],
                "task_state": {}, "extra_state": {"converted_from": os.path.abspath(checkpoint)},
                "last_optimizer_state": None}, out)
    return model.eval()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.convert", description=__doc__.split("\n\n")[0],
                                epilog="Other fairseq options of the arch may follow, e.g. --lion-form chunk.")
    p.add_argument("checkpoint", help="the softmax model's checkpoint (RoBERTa)")
    p.add_argument("out", help="where to write the LION checkpoint")
    p.add_argument("--arch", required=True, help="the LION arch, e.g. lion_s, lion_d, lion_lit_large")
    p.add_argument("--data", help="folder of the teacher's dict.txt (default: the checkpoint's folder)")
    args, extra = p.parse_known_args(argv)
    try:
        model = convert(args.checkpoint, args.out, args.arch, args.data, extra)
    except (ValueError, FileNotFoundError) as e:
        print(f"lion_fairseq.convert: {e}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {args.arch}, {params / 1e6:.1f}M parameters. Start from it with fairseq-train "
          f"--user-dir {PACKAGE_DIR} --arch {args.arch} --finetune-from-model {args.out} ..., or load it with "
          f"LionRobertaModel.from_pretrained({os.path.dirname(os.path.abspath(args.out))!r}, "
          f"{os.path.basename(args.out)!r}, <data>)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
