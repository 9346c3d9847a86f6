"""Benchmark of causal decoding: time per generated token against context length, ``lion_s_lm`` (an RNN
state of fixed size) against fairseq's ``transformer_lm`` (a key/value cache that grows) of the same size
(6 layers, 512 wide, 8 heads, FFN 2048), and the scoring throughput of both (eval-lm's inner loop).

    python -m lion_fairseq.benchmark.decode                    # contexts 64..16384, 1 thread
    python -m lion_fairseq.benchmark.decode --small            # contexts 64..1024: under a minute

Decoding: batch 1, float32, ``no_grad``, models in eval mode, both through their decoders' own
``incremental_state`` path, exactly as fairseq's ``SequenceGenerator`` calls them (the whole prefix each
step). The LION context is prefilled in one chunk-form call (its time is reported); the transformer's
cache is filled with random keys and values of the right shape (the cost of a step does not depend on
their values, and a real 16384-token softmax prefill would need an L x L score matrix per head). Each
length then times ``--steps`` generated tokens; the table gives the fastest step (the least disturbed by
other processes on a shared machine; the JSON also has the median). One thread by default: a batch-1 step
is many tiny ops, and on a busy 2-core machine a second OpenMP thread makes each of them wait for a
descheduled worker (measured: ~10 ms per ``gelu`` of 2048 numbers).

Scoring: fairseq's ``SequenceScorer`` (what ``fairseq-eval-lm`` runs per batch) over random tokens,
batches of ``--score-tokens`` tokens at each block length, LION in the chunk form. Untrained weights:
speed does not depend on them. Writes ``decode.md`` and ``decode.json`` into ``--out``.
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .operator import threads_name
from .options import default_text, fill_unset, out_folder, positive_int

VOCAB = 32000  # a typical subword vocabulary: the output projection costs the same for both models
# the options that --small shortens unless given: (full run, --small)
DEFAULTS = {"lengths": ([64, 256, 1024, 4096, 16384], [64, 256, 1024]), "steps": (32, 8),
            "score_blocks": ([512, 2048], [512])}


def build(arch: str, data: Path, max_positions: int, extra: List[str]) -> Tuple[object, nn.Module]:
    """(task, model) as ``fairseq-train`` builds them, in eval mode."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import lion_fairseq  # noqa: F401  (registers lion_s_lm)

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--task", "language_modeling", "--arch", arch,
                                                "--tokens-per-sample", str(max_positions), *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    return task, task.build_model(cfg.model).eval()


def write_dictionary(folder: Path, size: int) -> None:
    (folder / "dict.txt").write_text("".join(f"w{i} {size - i}\n" for i in range(size - 4)))


def fill_transformer_cache(model: nn.Module, state: Dict, batch: int, L: int) -> None:
    """Give every self-attention layer a key/value cache of L positions (random values)."""
    for layer in model.decoder.layers:
        attn = layer.self_attn
        shape = (batch, attn.num_heads, L, attn.head_dim)
        attn._set_input_buffer(state, {"prev_key": torch.randn(shape), "prev_value": torch.randn(shape),
                                       "prev_key_padding_mask": None})


def timed_steps(times: List[float]) -> List[float]:
    """The steps whose times count: all but the first (which may allocate), where more than two ran."""
    return times[1:] if len(times) > 2 else times


def time_decoding(model: nn.Module, kind: str, L: int, steps: int, vocab: int) -> Dict[str, float]:
    """Seconds per generated token (fastest and median step) after a context of L tokens, the state size
    and, for LION, the one-call prefill time."""
    torch.manual_seed(0)
    tokens = torch.randint(4, vocab, (1, L))
    state: Dict = {}
    out: Dict[str, float] = {}
    with torch.no_grad():
        if kind == "lion":
            t = time.perf_counter()
            # the prompt's features and state in one chunk-form call (its logits are not needed)
            model.decoder(tokens, incremental_state=state, features_only=True)
            out["prefill_s"] = time.perf_counter() - t
        else:
            fill_transformer_cache(model, state, 1, L - 1)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            logits, _ = model.decoder(tokens, incremental_state=state)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t)
            tokens = torch.cat([tokens, nxt], 1)
    times = timed_steps(times)
    out["per_token_s"], out["median_per_token_s"] = min(times), statistics.median(times)
    out["state_mib"] = sum(t.numel() * t.element_size() for d in state.values() for t in d.values()
                           if isinstance(t, torch.Tensor)) / 2 ** 20
    return out


def time_scoring(task, model: nn.Module, block: int, n_tokens: int, repeats: int) -> float:
    """Tokens per second of fairseq's SequenceScorer (eval-lm's per-batch work) on blocks of ``block``."""
    from fairseq.sequence_scorer import SequenceScorer

    batch = max(1, n_tokens // block)
    src = torch.randint(4, len(task.target_dictionary), (batch, block))
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), block)},
              "target": torch.roll(src, -1, 1), "ntokens": batch * block}
    scorer = SequenceScorer(task.target_dictionary)
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            t = time.perf_counter()
            scorer.generate([model], sample)
            best = min(best, time.perf_counter() - t)
    return batch * block / best


def fmt(x: Optional[float], scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.benchmark.decode", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                   help="context lengths " + default_text(DEFAULTS["lengths"]))
    p.add_argument("--steps", type=positive_int, default=None,
                   help="generated tokens per context length, the first not counted where more than two "
                        + default_text(DEFAULTS["steps"]))
    p.add_argument("--score-blocks", type=positive_int, nargs="+", default=None,
                   help="--tokens-per-sample of the scoring runs " + default_text(DEFAULTS["score_blocks"]))
    p.add_argument("--score-tokens", type=positive_int, default=4096, help="tokens per scoring batch")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--small", action="store_true",
                   help="contexts 64..1024, one scoring block (options given still apply)")
    p.add_argument("--out", type=out_folder, default=Path("outputs/benchmark/decode"))
    args = p.parse_args(argv)
    fill_unset(args, args.small, **DEFAULTS)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    max_pos = max(args.lengths + args.score_blocks) + args.steps + 8
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_dictionary(Path(tmp), VOCAB)
        models["lion"] = build("lion_s_lm", Path(tmp), max_pos, ["--lion-form", "chunk"])
        models["transformer"] = build("transformer_lm", Path(tmp), max_pos, [])
    params = {k: sum(p.numel() for p in m.parameters()) for k, (_, m) in models.items()}

    for kind, (task, model) in models.items():  # warm-up (allocator, first-call dispatch), not reported
        time_decoding(model, kind, args.lengths[0], 4, len(task.target_dictionary))
    decode: Dict[str, Dict[int, Dict[str, float]]] = {k: {} for k in models}
    for L in args.lengths:
        for kind, (task, model) in models.items():
            decode[kind][L] = time_decoding(model, kind, L, args.steps, len(task.target_dictionary))
            print(f"decode {kind:11s} L={L:6d}: {decode[kind][L]['per_token_s'] * 1e3:8.2f} ms/token", flush=True)
    scoring: Dict[str, Dict[int, float]] = {k: {} for k in models}
    for block in args.score_blocks:
        for kind, (task, model) in models.items():
            scoring[kind][block] = time_scoring(task, model, block, args.score_tokens, repeats=2)
            print(f"score  {kind:11s} block={block:5d}: {scoring[kind][block]:9.0f} tokens/s", flush=True)

    lion, tfm = decode["lion"], decode["transformer"]
    first = args.lengths[0]
    lines = [
        f"Decoding one token after L tokens of context, batch 1, float32, {threads_name(args.threads)}, "
        f"fastest of {len(timed_steps([0.0] * args.steps))} steps; lion_s_lm ({params['lion'] / 1e6:.1f} M parameters) vs "
        f"transformer_lm ({params['transformer'] / 1e6:.1f} M), vocabulary {VOCAB}.",
        "",
        "| L | lion_s_lm ms/token | lion state MiB | lion prefill s | transformer_lm ms/token | "
        "transformer cache MiB | transformer / lion |",
        "|---|---|---|---|---|---|---|",
    ]
    for L in args.lengths:
        lines.append(f"| {L} | {fmt(lion[L]['per_token_s'], 1e3, 2)} | {fmt(lion[L]['state_mib'], 1, 2)} | "
                     f"{fmt(lion[L].get('prefill_s'), 1, 2)} | {fmt(tfm[L]['per_token_s'], 1e3, 2)} | "
                     f"{fmt(tfm[L]['state_mib'], 1, 1)} | {tfm[L]['per_token_s'] / lion[L]['per_token_s']:.2f} |")
    last = args.lengths[-1]
    lines += ["", f"lion_s_lm per-token time at L={last} / at L={first}: "
                  f"{lion[last]['per_token_s'] / lion[first]['per_token_s']:.3f}; transformer_lm: "
                  f"{tfm[last]['per_token_s'] / tfm[first]['per_token_s']:.3f}.",
              "", "Scoring throughput (fairseq's SequenceScorer, eval-lm's inner loop), tokens/s:", "",
              "| tokens per sample | lion_s_lm (chunk) | transformer_lm |", "|---|---|---|"]
    for block in args.score_blocks:
        lines.append(f"| {block} | {scoring['lion'][block]:.0f} | {scoring['transformer'][block]:.0f} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    (args.out / "decode.md").write_text(text)
    (args.out / "decode.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "params": params,
         "decode": {k: {str(L): v for L, v in d.items()} for k, d in decode.items()},
         "scoring_tokens_per_s": {k: {str(b): v for b, v in d.items()} for k, d in scoring.items()}}, indent=1))


if __name__ == "__main__":
    main()
