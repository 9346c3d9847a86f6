"""One encoder layer, LION against fairseq's softmax ``TransformerEncoderLayer``, at RoBERTa-base width
(768, 12 heads, FFN 3072, post-norm, GELU, dropout 0.1):
time of forward+backward (train mode) and of forward (eval, ``no_grad``), and the peak memory of that
inference, at batch 1.

Run by ``python -m lion_fairseq.benchmark``, which starts each (layer, form, L) in a fresh process
(``python -m lion_fairseq.benchmark.layer KIND FORM L``) so that the peak resident memory it reports
(the rise of ``ru_maxrss`` over the built layer and its input) is its own."""
import argparse
import json
import time
from typing import Dict, List, Optional

import torch
from torch import nn

from .rss import maxrss_mib

WIDTH, HEADS, FFN = 768, 12, 3072
DROPOUT = 0.1
# Attention dropout 0 for every layer: torch then runs fairseq's softmax attention through its fused
# kernel (O(L) memory, the fastest softmax there is). With RoBERTa's 0.1 it takes the L x L path instead;
# the "softmax_ad" layer measures that.
KINDS = ("softmax", "softmax_ad", "lit", "d", "s")
# Lengths past which a layer is not run: the parallel form's L x L float64 log-mask (12 heads x L^2 x 8
# bytes, and more for its backward) and autograd through the recurrent form's token loop (a D x D state
# per token and head) would not fit 24 GiB or would take minutes.
LIMITS = {("parallel", "fwd"): 4096, ("parallel", "fwdbwd"): 2048, ("recurrent", "fwdbwd"): 1024,
          ("softmax_ad", "fwdbwd"): 8192}


def limit(kind: str, form: str, mode: str) -> int:
    """The longest L run for a layer and mode (softmax layers by kind, LION layers by form)."""
    return LIMITS.get((kind if kind.startswith("softmax") else form, mode), 1 << 30)


def build_layer(kind: str, form: str, chunk_size: int) -> nn.Module:
    """``softmax``: fairseq's ``TransformerEncoderLayer`` as RoBERTa builds it; ``lit``/``d``/``s``: the
    ``LionEncoderLayer`` that ``--arch lion_<kind>`` builds, in the given form."""
    if kind.startswith("softmax"):
        from fairseq.models.transformer import TransformerConfig
        from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

        cfg = TransformerConfig()
        cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim, cfg.encoder.attention_heads = WIDTH, FFN, HEADS
        cfg.dropout, cfg.activation_fn = DROPOUT, "gelu"
        cfg.attention_dropout = 0.1 if kind == "softmax_ad" else 0.0
        return TransformerEncoderLayerBase(cfg)
    from lion_fairseq.modules.encoder_layer import LionEncoderLayer

    return LionEncoderLayer(WIDTH, HEADS, FFN, dict(variant=kind, form=form, chunk_size=chunk_size), dropout=DROPOUT)


def _call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # fairseq's softmax layer takes the padding mask positionally (None: no padding)
    return layer(x, None)


def measure(kind: str, form: str, L: int, threads: int, chunk_size: int, repeats: int,
            modes: List[str]) -> Dict[str, Optional[float]]:
    """In the child process: best seconds of each mode over ``repeats`` and the inference peak MiB."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    layer = build_layer(kind, form, chunk_size)
    x = torch.randn(L, 1, WIDTH)
    out: Dict[str, Optional[float]] = {}
    layer.eval()
    with torch.no_grad():  # one-time set-up of thread pools and kernels is not the layer's memory
        _call(layer, x[:16])
    base = maxrss_mib()
    with torch.no_grad():
        _call(layer, x)
    out["peak_mib"] = maxrss_mib() - base
    for mode in modes:
        if L > limit(kind, form, mode):
            out[mode] = None
            continue
        best = float("inf")
        for _ in range(repeats):
            if mode == "fwd":
                layer.eval()
                t = time.perf_counter()
                with torch.no_grad():
                    _call(layer, x)
            else:
                layer.train()
                xi = x.clone().requires_grad_()
                t = time.perf_counter()
                _call(layer, xi).sum().backward()
            best = min(best, time.perf_counter() - t)
            layer.zero_grad(set_to_none=True)
        out[mode] = best
    return out


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.layer", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=KINDS)
    p.add_argument("form", choices=["parallel", "chunk", "recurrent"])
    p.add_argument("L", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    if args.L > limit(args.kind, args.form, "fwd"):
        print(json.dumps({"fwd": None, "fwdbwd": None, "peak_mib": None}))
        return
    print(json.dumps(measure(args.kind, args.form, args.L, args.threads, args.chunk_size, args.repeats,
                             ["fwd", "fwdbwd"])))


if __name__ == "__main__":
    main()
