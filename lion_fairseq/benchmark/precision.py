"""Mixed precision: the error of one attention module under autocast (what fairseq's ``--amp`` and bf16
runs do) against the same module in float64, LION in each form against fairseq's softmax
``MultiheadAttention`` at the same width.

``python -m lion_fairseq.benchmark.precision`` prints the table (and ``--json`` writes it). On CPU it runs
under CPU autocast, the stand-in for CUDA's: both cast the inputs of every matmul to the low precision
and keep reductions such as softmax and layer norm in float32. The error is the relative RMS
``||y - y64|| / ||y64||`` of the module's output, the weights and input being the same."""
import argparse
import json
import time
from typing import Dict, List, Optional

import torch
from torch import nn

WIDTH, HEADS = 256, 4
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = ("lit", "d", "s")
FORMS = ("parallel", "chunk", "recurrent")
# the parallel form's L x L float64 log-mask and softmax's L x L scores stop here (a few GiB beyond)
LONGEST = {"parallel": 4096, "softmax": 4096}


def build(kind: str, form: str = "chunk", seed: int = 0) -> nn.Module:
    """``softmax``: fairseq's ``MultiheadAttention`` (self-attention, as its encoder layer builds it);
    ``lit``/``d``/``s``: ``LionAttention`` with its defaults, in ``form``."""
    torch.manual_seed(seed)
    if kind == "softmax":
        from fairseq.modules import MultiheadAttention

        return MultiheadAttention(WIDTH, HEADS, self_attention=True)
    from lion_fairseq.modules import LionAttention

    return LionAttention(WIDTH, HEADS, kind, form=form)


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(module).__name__ == "MultiheadAttention":
        return module(x, x, x, need_weights=False)[0]
    return module(x)


def relative_error(kind: str, form: str, L: int, dtype: str, seed: int = 0, device: str = "cpu") -> float:
    """``||y - y64|| / ||y64||`` for the module's output under autocast to ``dtype`` (``"fp16"`` or
    ``"bf16"``) on ``device`` (``"cpu"`` or ``"cuda"``), the float64 reference from a float64 copy of the
    same module on the same input ``(L, 1, WIDTH)``. The reference of the recurrent and parallel forms at long
    L is the chunk form (the forms agree to round-off in float64, as the ops' tests check), which takes a tenth
    of a second where the scans take minutes and the float64 L x L matrices seconds."""
    from lion_fairseq.ops.float32 import autocast_enabled

    module = build(kind, form, seed).to(device).eval()
    x = torch.randn(L, 1, WIDTH, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    with torch.no_grad():
        with torch.autocast(device, dtype=DTYPES[dtype]):
            if not autocast_enabled(device):  # torch warns and runs float32, whose error would fill the column
                raise RuntimeError(f"torch {torch.__version__} cannot autocast to {dtype} on {device} (torch 2.1's "
                                   "CPU autocast takes bfloat16 only): upgrade torch to measure it")
            y = _call(module, x)
        reference = build(kind, "chunk" if form != "chunk" and L > 1024 else form, seed).to(device).double().eval()
        reference.load_state_dict(module.state_dict())
        y64 = _call(reference, x.double())
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y.double() - y64).norm() / y64.norm())


def cases(lengths: List[int]) -> List[Dict]:
    """Every (module, form, L) of the table: softmax and the parallel form up to ``LONGEST``."""
    out = [dict(kind="softmax", form="-", L=L) for L in lengths if L <= LONGEST["softmax"]]
    out += [dict(kind=v, form=f, L=L) for v in VARIANTS for f in FORMS for L in lengths
            if L <= LONGEST.get(f, L)]
    return out


def measure(lengths: List[int], threads: int, device: str = "cpu") -> List[Dict]:
    torch.set_num_threads(threads)
    rows = []
    for case in cases(lengths):
        row = dict(case)
        for dtype in DTYPES:
            start = time.perf_counter()
            row[dtype] = relative_error(case["kind"], case["form"] if case["form"] != "-" else "chunk",
                                        case["L"], dtype, device=device)
            row[f"{dtype}_s"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: List[Dict]) -> str:
    """Markdown: the error of each module per L and dtype, with softmax's at the same L beside it."""
    softmax = {r["L"]: r for r in rows if r["kind"] == "softmax"}
    lines = ["| module | form | L | fp16 error | bf16 error | fp16 / softmax's | bf16 / softmax's |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = softmax.get(r["L"])
        ratio = {d: f"{r[d] / s[d]:.1f}" if s else "-" for d in DTYPES}
        name = "softmax (fairseq MultiheadAttention)" if r["kind"] == "softmax" else f"lion_{r['kind']}"
        lines.append(f"| {name} | {r['form']} | {r['L']} | {r['fp16']:.1e} | {r['bf16']:.1e} | "
                     f"{ratio['fp16']} | {ratio['bf16']} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.precision", description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    rows = measure(args.lengths, args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\nError under CPU autocast against float64, width {WIDTH}, {HEADS} heads, batch 1:\n")
    print(table(rows))


if __name__ == "__main__":
    main()
