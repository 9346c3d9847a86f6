"""Tuning LION's Triton kernel on a GPU: ``python -m lion_fairseq.benchmark.gpu --out DIR --tune``.

The kernel takes its chunk size and warps from ``kernel.BLOCKS`` (by head size, forward and backward), its
loops' pipelining stages from ``kernel.STAGES``, whether its walks load the next chunk ahead from
``kernel.PREFETCH``, whether a bidirectional backward does both of its parts in one walk each way from
``kernel.FUSED``, and cuts its walks into segments until there are about ``kernel.PROGRAMS_PER_SM``
programs per streaming multiprocessor. They were chosen without a GPU (the largest chunk that spills no
registers on sm_90; Triton's default stages; no prefetch; fused where that spills little). This times
LION-S (per-token gates; bf16, or fp16 where a pass says so; the benchmark's heads, head size and tokens
per batch) at each ``--tune-lengths`` L over the candidates:

1. the forward's (chunk, warps) in ``FORWARD`` times ``PROGRAMS``, timed forward only (inference);
2. the kernel as it ships, forward+backward, for the comparison;
3. with the fastest forward's, the backward's (chunk, warps) in ``BACKWARD`` times ``PROGRAMS``, timed
   forward+backward; then at the fastest of those programs, ``BACKWARD`` fused and not; then the fastest
   of those fused and not in fp16 (what ``fairseq-train --fp16`` and ``--amp`` feed the kernel: its fused
   walks spill more registers than bf16's, ``docs/gpu.md``);
4. with the fastest of each, the forward's stages in ``STAGES`` (timed forward), then the backward's
   (forward+backward);
5. with the fastest of those, the forward walks loading ahead (timed forward), then the backward's
   (forward+backward).

Every candidate first computes values and gradients once, compared with the PyTorch chunk form on the same
inputs (``gpu.compare``, bf16 tolerances): a fast configuration that is wrong is reported as such, not
chosen. Writes ``tune.md`` and ``tune.json`` into ``--out`` after every candidate. It changes nothing in the
kernel: what to ship is for whoever reads the table to put into ``BLOCKS``, ``STAGES``, ``PREFETCH``,
``FUSED`` and ``PROGRAMS_PER_SM``."""
import json
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

FORWARD = ((16, 4), (16, 8), (32, 4), (32, 8), (64, 4), (64, 8))
BACKWARD = ((16, 4), (16, 8), (32, 4), (32, 8))
PROGRAMS = (2, 4, 8)
STAGES = (1, 2, 3, 4)


def shipped(D: int) -> Dict:
    """The forward's and backward's (chunk, warps), the programs per SM, the (forward, backward) stages
    and prefetch, and whether the backward is fused, as the kernel ships at head size D."""
    from lion_fairseq.ops import kernel

    head = kernel.head_class(D)
    return {"forward": kernel.BLOCKS[False][head], "backward": kernel.BLOCKS[True][head],
            "programs": kernel.PROGRAMS_PER_SM, "stages": (kernel.STAGES[False], kernel.STAGES[True]),
            "prefetch": (kernel.PREFETCH[False], kernel.PREFETCH[True]), "fused": kernel.FUSED[head]}


def candidate(inputs: list, weight, ref: tuple, mode: str, warmup: int, iters: int, device: str,
              dtype_name: str = "bfloat16") -> Dict:
    """Under the configuration in force: the chunk and segments the kernel takes, its values and gradients
    against ``ref`` (``gpu.compare`` at ``dtype_name``'s tolerances), and the median ms of ``mode`` ("fwd" or
    "fwdbwd") where they agree."""
    import torch

    from lion_fairseq.ops import kernel

    from .gpu import INPUT_NAMES, compare, outputs, runner, time_ms, timed_calls

    q, v = inputs[0], inputs[2]
    cfg = kernel._Config(q, v, 64, None)
    if mode == "fwdbwd":  # the backward's chunks, in the forward's segments where they divide them
        cfg = kernel._backward_config(q, v, 64, None, cfg.Q * cfg.C if cfg.nseg > 1 else None)
    row = {"chunk": cfg.C, "segments": cfg.nseg}
    row.update(compare(outputs(inputs, weight, "triton", False), ref, list(INPUT_NAMES), dtype_name))
    if not row["ok"]:
        return row
    row["ms"] = time_ms(timed_calls(runner("lion-s-triton"), inputs, torch.randn_like(v))[mode], warmup, iters,
                        device)
    return row


def sweep(L: int, B: int, H: int, D: int, warmup: int, iters: int, over: Callable[[], bool],
          record: Callable[[Dict], None], device: str = "cuda", forward: Tuple = FORWARD,
          backward: Tuple = BACKWARD, programs: Tuple = PROGRAMS, stages: Tuple = STAGES) -> None:
    """The passes of the tuning at one L (see the module's docstring); each row goes to ``record`` as it
    is measured: ``{"L", "B", "pass", "forward", "backward", "programs", "stages", "prefetch", "fused",
    "chunk", "segments", "ok", "errors", "ms"}``, or ``"skipped"`` once ``over()``."""
    import torch

    from lion_fairseq.ops.kernel import configured

    from .gpu import cuda_lost, make_inputs, outputs

    weight = torch.randn(B, H, L, D, device=device, generator=torch.Generator(device=device).manual_seed(1))

    def data(dtype_name: str) -> tuple:
        """LION-S's inputs in that dtype, the PyTorch form's values and gradients on them, the dtype's name."""
        inputs = make_inputs(B, H, L, D, getattr(torch, dtype_name), "token", grad=True, device=device)
        return inputs, outputs(inputs, weight, "torch", False), dtype_name

    bf16 = data("bfloat16")
    ships = shipped(D)
    lost: List[str] = []  # a fault that left this process's GPU unusable: the candidates after it are not run

    def one(pas: str, fwd, bwd, progs: int, st=ships["stages"], ahead=ships["prefetch"],
            fused=ships["fused"], data: tuple = bf16) -> Optional[Dict]:
        row = {"L": L, "B": B, "pass": pas, "forward": list(fwd), "backward": list(bwd), "programs": progs,
               "stages": list(st), "prefetch": list(ahead), "fused": fused}
        if over() or lost:
            row["skipped"] = "budget" if not lost else "CUDA context lost"
        else:
            try:
                with configured(D, fwd, bwd, progs, st, ahead, fused):
                    row.update(candidate(data[0], weight, data[1], "fwd" if pas.startswith("forward") else
                                         "fwdbwd", warmup, iters, device, data[2]))
            except Exception as e:  # one candidate that does not compile or run: recorded, the rest goes on
                row["error"] = repr(e)[:300]
                reason = cuda_lost() if device == "cuda" else None
                if reason:
                    lost.append(reason)
            if device == "cuda" and not lost:
                torch.cuda.empty_cache()
        record(row)
        return row if "ms" in row else None

    def fastest(rows: List[Optional[Dict]], default: Dict) -> Dict:
        timed = [r for r in rows if r]
        return min(timed, key=lambda r: r["ms"]) if timed else default

    f = fastest([one("forward", c, ships["backward"], p) for p in programs for c in forward], ships)
    one("shipped", ships["forward"], ships["backward"], ships["programs"])
    b = fastest([one("backward", f["forward"], c, p) for p in programs for c in backward], ships)
    b = fastest([one("backward fused", f["forward"], c, b["programs"], fused=u) for u in (False, True)
                 for c in backward], b)
    # made only where it will run: one() records the rows as skipped otherwise
    fp16 = data("float16") if not over() and not lost else None
    for u in (False, True):
        one("backward fused fp16", f["forward"], b["backward"], b["programs"], fused=u, data=fp16)
    fs = fastest([one("forward stages", f["forward"], ships["backward"], f["programs"], (n, ships["stages"][1]))
                  for n in stages], {"stages": ships["stages"]})["stages"][0]
    bs = fastest([one("backward stages", f["forward"], b["backward"], b["programs"], (fs, n), fused=b["fused"])
                  for n in stages], {"stages": ships["stages"]})["stages"][1]
    fa = fastest([one("forward prefetch", f["forward"], ships["backward"], f["programs"], (fs, ships["stages"][1]),
                      (a, ships["prefetch"][1])) for a in (False, True)], {"prefetch": ships["prefetch"]})
    for a in (False, True):
        one("backward prefetch", f["forward"], b["backward"], b["programs"], (fs, bs), (fa["prefetch"][0], a),
            b["fused"])


def best_rows(rows: List[Dict]) -> List[Dict]:
    """Per L and pass, the fastest row that agreed with the PyTorch form."""
    best: Dict[tuple, Dict] = {}
    for r in rows:
        key = (r["L"], r["pass"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    return list(best.values())


def markdown(report: Dict) -> str:
    env, a = report["environment"], report["args"]
    lines = ["# Tuning LION's Triton kernel: LION-S, bf16 (fp16 where the pass says so)", "",
             ", ".join(f"{k} {v}" for k, v in env.items()), "",
             f"`python -m lion_fairseq.benchmark.gpu --tune`: H = {a['heads']}, D = {a['dim']}, {a['tokens']} tokens "
             f"per batch, median of {a['iters']} after {a['warmup']} warm-up calls. Rows whose pass starts with "
             "'forward' time the forward alone; the others time forward+backward. The kernel ships with forward "
             f"{tuple(report['shipped']['forward'])}, backward {tuple(report['shipped']['backward'])} (chunk, "
             f"warps), {report['shipped']['programs']} programs per SM, (forward, backward) stages "
             f"{tuple(report['shipped']['stages'])}, prefetch {tuple(report['shipped']['prefetch'])} and fused "
             f"backward {report['shipped']['fused']}.", "",
             "| L | B | pass | forward (chunk, warps) | backward (chunk, warps) | programs per SM | stages | prefetch "
             "| fused | segments | ms | values error | worst gradient error | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        head = (f"| {r['L']} | {r['B']} | {r['pass']} | {tuple(r['forward'])} | {tuple(r['backward'])} | "
                f"{r['programs']} | {tuple(r['stages'])} | {tuple(r['prefetch'])} | {r['fused']} |")
        if "skipped" in r or "error" in r:
            lines.append(f"{head} {r.get('error') or 'skipped (' + r['skipped'] + ')'} | | | | |")
            continue
        grads = {k: v for k, v in r["errors"].items() if k != "values"}
        worst = max(grads, key=grads.get)
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        lines.append(f"{head} {r['segments']} | {ms} | {r['errors']['values']:.1e} | {worst} {grads[worst]:.1e} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    if "error" in report:
        lines += ["", f"Stopped {report['error']}"]
    lines += ["", "Fastest that agree, by L and pass:", ""]
    for r in best_rows(report["rows"]):
        lines.append(f"- L = {r['L']}, {r['pass']}: forward {tuple(r['forward'])}, backward {tuple(r['backward'])}, "
                     f"{r['programs']} programs per SM, stages {tuple(r['stages'])}, prefetch {tuple(r['prefetch'])}, "
                     f"fused {r['fused']}: {r['ms']:.3f} ms")
    return "\n".join(lines) + "\n"


def run(args, out: Path, environment: Dict) -> int:
    """The ``--tune`` run: every ``--tune-lengths`` L in turn, within ``--budget-s``; 1 if a candidate
    disagreed with the PyTorch form or failed."""
    report = {"environment": environment, "args": vars(args), "shipped": shipped(args.dim), "rows": []}
    started = time.time()

    def record(row: Dict) -> None:
        report["rows"].append(row)
        print(f"tune {row}", flush=True)
        (out / "tune.json").write_text(json.dumps(report, indent=1))
        (out / "tune.md").write_text(markdown(report))

    for L in (int(x) for x in args.tune_lengths.split(",")):
        try:
            sweep(L, max(1, args.tokens // L), args.heads, args.dim, args.warmup, args.iters,
                  lambda: time.time() - started > args.budget_s, record)
        except Exception as e:  # the inputs or the PyTorch form's reference failed (a lost GPU, say): stop
            report["error"] = f"at L = {L}: {e!r}"[:300]
            break
    (out / "tune.json").write_text(json.dumps(report, indent=1))
    (out / "tune.md").write_text(markdown(report))
    print(markdown(report))
    bad = [r for r in report["rows"] if "error" in r or ("ok" in r and not r["ok"])]
    return 1 if bad or "error" in report else 0
