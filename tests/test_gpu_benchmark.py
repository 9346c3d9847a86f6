"""``python -m lion_fairseq.benchmark.gpu`` on CPU, so that a lent GPU's minutes go to the GPU: each of its
parts run here at tiny size (the kernel under Triton's interpreter, fairseq in float32 with ``cpu: true``),
and its report written from a made-up result with every kind of cell."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lion_fairseq.benchmark import gpu, gpu_training, gpu_tune

ROOT = Path(__file__).resolve().parents[1]
needs_kernel = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="the kernel runs under TRITON_INTERPRET=1 or on CUDA")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        import triton_interpreter

        triton_interpreter.install()


def test_help(capsys):
    with pytest.raises(SystemExit) as done:
        gpu.main(["--help"])
    assert done.value.code == 0 and "--out" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine it would run the whole benchmark")
def test_refuses_clearly_without_cuda(tmp_path):
    run = subprocess.run([sys.executable, "-m", "lion_fairseq.benchmark.gpu", "--out", str(tmp_path / "out")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "needs a CUDA GPU" in run.stderr
    assert not (tmp_path / "out").exists()


@needs_kernel
@pytest.mark.parametrize("L,dtype,causal,gates", [(33, "float32", False, "token"), (1, "bfloat16", True, "head"),
                                                  (20, "bfloat16", False, "none"), (33, "float16", True, "token"),
                                                  (40, "float16", False, "strong")])
def test_check_compares_the_kernel_with_the_pytorch_form(L, dtype, causal, gates):
    c = gpu.check(L, dtype, causal, gates, device="cpu", B=1, H=2, D=16)
    assert c["ok"] and c["finite"], c
    named = {"dq", "dk"} if L > 1 else set()
    named |= {"dv"} | ({"dlog_a_fwd"} if gates != "none" else set())
    named |= {"dlog_a_bwd"} if gates != "none" and not causal else set()
    assert set(c["errors"]) == {"values"} | named


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_check_compares_the_feature_map_kernel_with_float64(dtype):
    c = gpu.check_feature_map(40, dtype, device="cpu", B=2, H=3, D=32)
    assert c["ok"] and c["finite"] and set(c["errors"]) == {"values", "dx"}, c
    assert c["errors"]["values"] < {"float32": 1e-6, "bfloat16": 3e-3, "float16": 5e-4}[dtype]


def test_check_cases_cover_every_gate_kind_in_both_16_bit_dtypes():
    """fairseq-train's --fp16 and --amp feed the kernel float16, fairseq-hydra-train's bf16 bfloat16: a GPU
    check that leaves either out would let the default on CUDA change unchecked for those users."""
    cases = gpu.check_cases([1, 1000])
    every = {(L, ca, g) for L in (1, 1000) for ca in (False, True) for g in gpu.GATES + ("strong",)} - {
        (1, ca, "strong") for ca in (False, True)}
    for dtype in ("bfloat16", "float16"):
        assert {(c[0], c[2], c[3]) for c in cases if c[1] == dtype and c[4] == 64} == every
    assert {c[0] for c in cases} == {1, 1000}
    # head size 128's blocks and split backward walks: every gate kind, at the longest L
    assert {c[3] for c in cases if c[4] == 128 and c[1] == "bfloat16" and not c[2]} == set(gpu.GATES)
    assert {c[0] for c in cases if c[4] == 128} == {1000}


@needs_kernel
def test_measure_times_the_kernel_with_its_estimated_rates():
    r = gpu.measure("lion-d-triton", 1, 2, 40, 16, warmup=0, iters=1, device="cpu")
    assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["fwd_tflops"] > 0 and r["fwdbwd_gbps"] > 0


@needs_kernel
def test_tune_checks_and_times_each_candidate_then_restores_the_kernel():
    """``--tune``'s sweep at tiny size: every candidate checked against the PyTorch form and timed, the
    kernel's blocks as they ship timed beside them, and the kernel's configuration unchanged afterwards."""
    from lion_fairseq.ops import kernel

    before = (json.dumps(kernel.BLOCKS), kernel.PROGRAMS_PER_SM, json.dumps(kernel.STAGES),
              json.dumps(kernel.PREFETCH), json.dumps(kernel.FUSED))
    rows = []
    gpu_tune.sweep(40, 1, 2, 16, 0, 1, lambda: False, rows.append, device="cpu", forward=((16, 4), (32, 8)),
                   backward=((16, 8),), programs=(2,), stages=(2, 3))
    assert [r["pass"] for r in rows] == ["forward"] * 2 + ["shipped", "backward"] + ["backward fused"] * 2 + [
        "backward fused fp16"] * 2 + ["forward stages"] * 2 + ["backward stages"] * 2 + [
        "forward prefetch"] * 2 + ["backward prefetch"] * 2
    assert all(r["ok"] and r["ms"] > 0 and r["segments"] == 1 for r in rows), rows
    fastest = min(rows[:2], key=lambda r: r["ms"])["forward"]
    assert all(r["forward"] == fastest for r in rows[3:]) and [r["stages"] for r in rows[8:10]] == [[2, 3], [3, 3]]
    assert [r["fused"] for r in rows[4:6]] == [False, True] and [r["fused"] for r in rows[6:8]] == [False, True]
    fused = min(rows[4:6], key=lambda r: r["ms"])["fused"]  # the fused pass chooses among its own rows
    assert all(r["backward"] == min(rows[4:6], key=lambda r: r["ms"])["backward"] for r in rows[6:8])
    assert all(r["fused"] == fused for r in rows[10:12] + rows[14:])
    assert rows[10]["stages"][0] == min(rows[8:10], key=lambda r: r["ms"])["stages"][0]
    assert [r["prefetch"] for r in rows[12:]] == [[False, False], [True, False]] + [
        [min(rows[12:14], key=lambda r: r["ms"])["prefetch"][0], a] for a in (False, True)]
    assert all(r["stages"] == rows[-1]["stages"] for r in rows[14:])
    assert (json.dumps(kernel.BLOCKS), kernel.PROGRAMS_PER_SM, json.dumps(kernel.STAGES),
            json.dumps(kernel.PREFETCH), json.dumps(kernel.FUSED)) == before
    skipped = {k: rows[0][k] for k in ("L", "B", "pass", "forward", "backward", "programs", "stages", "prefetch",
                                       "fused")}
    report = {"environment": {"gpu": "none"}, "args": vars(gpu.parse_args(["--out", "x"])),
              "shipped": gpu_tune.shipped(16), "rows": rows + [dict(skipped, skipped="budget")]}
    md = gpu_tune.markdown(report)
    assert md.count("| 40 | 1 |") == 17 and "L = 40, backward prefetch:" in md
    assert "L = 40, backward fused fp16:" in md
    assert "| 40 | 1 | forward | (16, 4) | (16, 8) | 2 | (3, 3) | (False, False) | True | skipped (budget) | | | | |" in md


def test_tune_configuration_is_restored_after_an_error():
    from lion_fairseq.ops import kernel

    before = (json.dumps(kernel.BLOCKS), kernel.PROGRAMS_PER_SM, json.dumps(kernel.STAGES),
              json.dumps(kernel.PREFETCH), json.dumps(kernel.FUSED))
    with pytest.raises(RuntimeError):
        with kernel.configured(64, (64, 4), (32, 4), 8, (1, 4), (True, False), not kernel.FUSED[64]):
            assert kernel.BLOCKS[False][64] == (64, 4) and kernel.BLOCKS[True][64] == (32, 4)
            assert kernel.PROGRAMS_PER_SM == 8 and kernel.STAGES == {False: 1, True: 4}
            assert kernel.PREFETCH == {False: True, True: False} and kernel.FUSED[64] != json.loads(before[4])["64"]
            raise RuntimeError("a candidate that fails")
    assert (json.dumps(kernel.BLOCKS), kernel.PROGRAMS_PER_SM, json.dumps(kernel.STAGES),
            json.dumps(kernel.PREFETCH), json.dumps(kernel.FUSED)) == before


@needs_kernel
def test_feature_map_timing_restores_the_backend(monkeypatch):
    monkeypatch.setenv("LION_BACKEND", "fla")
    r = gpu.measure_feature_map(40, 2, 16, 0, 1, device="cpu")
    assert r["torch_ms"] > 0 and r["triton_ms"] > 0 and os.environ["LION_BACKEND"] == "fla"


def test_kernel_cost_counts_both_walks():
    """Gated, the forward is two walks of four products (2 C D or 2 D^2 per token each) and the segments'
    sums; without gates, the sums and one read of the total state. Before a backward the forward also keeps
    y's second half; the backward reads dy and y's pair once for dden, its launches (two fused, else four)
    each read q, k, v and dy, and dq, dk, dv are each a pair written, read, and a row written."""
    gated = gpu.kernel_cost(1, 1, 1, 64, "token", "fwd", chunks=(64, 16))
    assert gated["flops"] == 2 * (4 * 64 * 64 + 4 * 64 * 64) + 4 * 64 * 64
    fwd, both = (gpu.kernel_cost(1, 1, 1, 64, "token", m, segments=False) for m in ("fwd", "fwdbwd"))
    assert both["bytes"] - fwd["bytes"] == (1 + 3 + 2 * 4 + 3 * 5) * 64 * 2 + 32
    split = gpu.kernel_cost(1, 1, 1, 64, "token", "fwdbwd", segments=False, fused=False)
    assert split["bytes"] - both["bytes"] == 2 * 4 * 64 * 2 + 16 and split["flops"] == both["flops"]
    # in segments, per-token gates take the keys' states from the forward; a per-head gate's backward sums
    # them again (two directions' k, v), with the distance-weighted sums beside them
    token, head = (gpu.kernel_cost(1, 1, 1, 64, g, "fwdbwd") for g in ("token", "head"))
    assert head["bytes"] - token["bytes"] == 4 * 64 * 2 and head["flops"] - token["flops"] == 4 * 64 * 64
    assert fwd["bytes"] == (6 + 2 * 2 + 1) * 64 * 2 + 12
    # float32 sums need no second half
    assert gpu.kernel_cost(1, 1, 1, 64, "token", "fwd", segments=False, in_bytes=4)["bytes"] == 9 * 64 * 4 + 12
    assert gpu.kernel_cost(1, 1, 1, 64, "none", "fwd")["flops"] == 4 * 64 * 64
    both = gpu.kernel_cost(2, 3, 5, 64, "head", "fwdbwd")
    assert both["flops"] > 3 * gpu.kernel_cost(2, 3, 5, 64, "head", "fwd")["flops"]


def test_speed_runs_pair_every_softmax_model_with_lion_on_the_kernel():
    runs = gpu.speed_runs(gpu.parse_args(["--out", "x", "--train-lengths", "512,2048,8192"]))
    for L in (512, 2048, 8192):
        assert ("lm", "transformer_lm", None, L) in runs and ("lm", "lion_s_lm", "triton", L) in runs
        assert ("mlm", "roberta_base", None, L) in runs and ("mlm", "lion_s", "triton", L) in runs
    assert ("lm", "lion_s_lm", "fla", 2048) in runs


@needs_kernel
def test_speed_run_eval_lm_and_recurrent_decoding(tmp_path, one_thread):
    """The end-to-end part at tiny size in float32: fairseq-hydra-train of a LION LM on the kernel and of
    RoBERTa (fairseq's wps, a checkpoint kept for the LM), fairseq-eval-lm of that checkpoint in every form
    with the same loss, and greedy recurrent decoding that the parallel form's argmax confirms."""
    tiny_lm = {"decoder_layers": 2, "decoder_embed_dim": 64, "decoder_ffn_embed_dim": 128, "decoder_attention_heads": 2}
    lm = gpu_training.train_speed(tmp_path, "lm", "lion_s_lm", 64, "triton", tokens=256, updates=5,
                                  keep_checkpoint=True, device="cpu", model=tiny_lm)
    assert "error" not in lm, lm
    assert lm["B"] == 4 and lm["wps"] > 0 and len(lm["losses"]) == 5 and Path(lm["checkpoint"]).exists()
    tiny_enc = {"encoder_layers": 2, "encoder_embed_dim": 64, "encoder_ffn_embed_dim": 128, "encoder_attention_heads": 2}
    mlm = gpu_training.train_speed(tmp_path, "mlm", "roberta_base", 64, None, tokens=256, updates=4, device="cpu",
                                   model=tiny_enc)
    assert "error" not in mlm and mlm["wps"] > 0 and "checkpoint" not in mlm, mlm
    forms = gpu_training.eval_lm_forms(Path(lm["checkpoint"]), 64, device="cpu",
                                       forms=("parallel", "chunk-triton", "recurrent"))
    losses = [r["loss"] for r in forms.values()]
    assert len(losses) == 3 and max(losses) - min(losses) < 1e-3, forms
    dec = gpu_training.recurrent_decoding(Path(lm["checkpoint"]), device="cpu", prompt_tokens=20, new_tokens=8)
    assert dec["new_tokens"] == 8 and dec["agree"] == 8 and dec["ms_per_token"] > 0, dec


def test_report_has_every_table(tmp_path):
    report = {"environment": {"gpu": "none", "torch": torch.__version__},
              "args": vars(gpu.parse_args(["--out", str(tmp_path)])),
              "check": [{"L": 1000, "dtype": "bfloat16", "causal": False, "gates": "head", "finite": True, "ok": True,
                         "errors": {"values": 3e-3, "dq": 5e-3, "dlog_a_fwd": 8e-3}},
                        {"L": 1, "dtype": "float32", "causal": True, "gates": "token", "ok": False,
                         "error": "RuntimeError('x')"}],
              "timing": [{"L": 1024, "B": 32, "results": {
                  "lion-s-triton": {"fwd_ms": 0.5, "fwdbwd_ms": 1.5, "fwd_mib": 10.0, "fwdbwd_mib": 40.0,
                                    "fwd_tflops": 60.0, "fwd_gbps": 1200.0, "fwdbwd_tflops": 50.0,
                                    "fwdbwd_gbps": 900.0},
                  "sdpa": {"fwd_ms": "OOM"}, "lion-s-fla": {"fwd_ms": "skipped (budget)"}}}],
              "speed": [{"task": "lm", "arch": "transformer_lm", "backend": None, "L": 512, "B": 32, "wps": 1e5,
                         "seconds": 20.0},
                        {"task": "lm", "arch": "lion_s_lm", "backend": "triton", "L": 512, "B": 32, "wps": 1.5e5,
                         "vs_softmax": 1.5, "seconds": 21.0},
                        {"task": "mlm", "arch": "lion_s", "backend": "triton", "L": 8192, "error": "skipped (budget)"}],
              "eval_lm": {"checkpoint": "lion_s_lm, L = 512", "forms": {"parallel": {"loss": 7.5, "ppl": 181.0},
                                                                       "chunk-fla": {"error": "exit 1: x"}}},
              "decoding": {"prompt_tokens": 64, "new_tokens": 64, "ms_per_token": 3.5, "agree": 64},
              "cuda_lost": "after lion-s-triton at L = 4096: AcceleratorError('illegal memory access')",
              "feature_map": {"torch_ms": 0.5, "triton_ms": 0.1}}
    gpu.save(tmp_path, report)
    md = (tmp_path / "gpu.md").read_text()
    assert "| 1000 | bfloat16 | False | head | 64 | 3.00e-03 | dlog_a_fwd 8.00e-03 | yes |" in md
    assert "| 1 | float32 | True | token | 64 | error: RuntimeError('x') | | NO |" in md
    assert "| 1024 | 32 | 0.5 | - | - | skipped (budget) | - | OOM |" in md
    assert "| 1024 | lion-s-triton | 60 | 1.2e+03 | 50 | 900 |" in md
    assert "| lm | lion_s_lm | triton | 512 | 32 | 1.5e+05 | 1.5 | 21.0 |" in md
    assert "| mlm | lion_s | triton | 8192 | | error: 'skipped (budget)' | | |" in md
    assert "PyTorch: 0.5 ms; its Triton kernel: 0.1 ms." in md
    assert "| parallel | 7.5 | 181 |" in md and "| chunk-fla | error: 'exit 1: x' | |" in md
    assert "64 greedy tokens after a 64-token prompt, 3.5 ms per token" in md and "agrees at 64 of 64" in md
    assert "became unusable in the benchmark's process** (after lion-s-triton at L = 4096: AcceleratorError" in md
    assert gpu.json.loads((tmp_path / "gpu.json").read_text())["timing"][0]["B"] == 32


def test_rates_are_read_against_the_gpu_that_ran():
    """A loan may be an H100 (3.35 TB/s) as well as an H200 (4.8 TB/s): the rates table names the peaks of
    the GPU torch reports, and says so where it knows none."""
    assert "3.35 TB/s" in gpu.rates_line("NVIDIA H100 80GB HBM3")
    assert "2.00 TB/s, 756 dense" in gpu.rates_line("NVIDIA H100 PCIe")
    assert "H200's data sheet): 4.80 TB/s, 989 dense" in gpu.rates_line("NVIDIA H200")
    assert "no data sheet known for 'NVIDIA A100-SXM4-80GB'; an H200's" in gpu.rates_line("NVIDIA A100-SXM4-80GB")


def test_mixed_precision_training_part_trains_and_compares_the_forms(tmp_path, one_thread):
    """``--mixed-precision-runs``' harness in float32 on CPU: a real fairseq-train, then the checkpoint's
    loss in every form and chunk-form backend."""
    row = gpu_training.train_and_evaluate(tmp_path, "s", "fp32", arch_suffix="_tiny", length=64, updates=3,
                                          device="cpu")
    assert row["ok"], row
    assert len(row["losses"]) == 3 and row["losses"][-1] < row["losses"][0]
    assert set(row["forms"]) == set(gpu_training.FORMS) and row["forms_agree"]


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    """``gpu.main`` on CPU with every part that needs a GPU replaced by a stand-in that records its call."""
    calls = []
    monkeypatch.setattr(gpu.tempfile, "tempdir", str(tmp_path))  # where the default --work folder is made
    monkeypatch.setattr(gpu, "refuse_reason", lambda: None)
    monkeypatch.setattr(gpu, "environment", lambda: {"gpu": "stand-in"})
    monkeypatch.setattr(gpu, "fla_missing", lambda: None)
    monkeypatch.setattr(gpu, "measure_feature_map", lambda *a: {"torch_ms": 2.0, "triton_ms": 1.0})
    monkeypatch.setattr(gpu, "check_feature_map", lambda L, dt: calls.append(("feature map", dt)) or {
        "L": L, "dtype": dt, "causal": False, "gates": gpu.FEATURE_MAP, "ok": True, "finite": True,
        "errors": {"values": 0.0, "dx": 0.0}})

    def train_speed(root, task, arch, L, backend, **kw):
        calls.append(("train", arch, backend, L))
        root.mkdir(parents=True, exist_ok=True)
        (root / f"{task}-{arch}-{backend}-{L}.log").write_text("a fairseq run's log")
        row = {"task": task, "arch": arch, "backend": backend, "L": L, "B": 1, "wps": 1.0, "seconds": 1.0}
        return dict(row, checkpoint=str(root / "ckpt.pt")) if kw.get("keep_checkpoint") else row

    monkeypatch.setattr(gpu, "train_speed", train_speed)
    monkeypatch.setattr(gpu, "eval_lm_forms", lambda ckpt, L, forms: calls.append(("eval_lm", L)) or
                        {f: {"loss": 1.0, "ppl": 2.0} for f in forms})
    monkeypatch.setattr(gpu, "recurrent_decoding", lambda ckpt: calls.append(("decoding",)) or
                        {"prompt_tokens": 4, "new_tokens": 4, "ms_per_token": 1.0, "agree": 4})
    return calls


def test_main_evaluates_the_forms_as_soon_as_the_checkpoint_exists(tmp_path, stubbed, monkeypatch):
    monkeypatch.setattr(gpu, "check", lambda L, dt, causal, gates, D=64: {"L": L, "dtype": dt, "causal": causal,
                                                                     "gates": gates, "ok": True, "finite": True,
                                                                     "errors": {"values": 0.0, "dv": 0.0}})
    monkeypatch.setattr(gpu, "measure", lambda impl, *a: stubbed.append(("measure", impl)) or {"fwd_ms": 1.0})
    out = tmp_path / "out"
    assert gpu.main(["--out", str(out), "--lengths", "1024", "--check-lengths", "1"]) == 0
    # the report alone in --out (a lent machine's tool brings back 8 files), the runs' files beside it
    assert sorted(p.name for p in out.iterdir()) == ["gpu.json", "gpu.md"]
    work, = tmp_path.glob("lion-gpu-*")
    assert len(list(work.glob("*.log"))) == 13
    trains = [i for i, c in enumerate(stubbed) if c[0] == "train"]
    assert stubbed.index(("eval_lm", 512)) == trains[1] + 1 and stubbed[trains[1]][1:] == ("lion_s_lm", "triton", 512)
    assert stubbed.index(("decoding",)) < trains[2] and len(trains) == 13
    assert stubbed[:3] == [("feature map", "float32"), ("feature map", "bfloat16"), ("feature map", "float16")]
    assert len([c for c in stubbed if c[0] == "measure"]) == len(gpu.IMPLS)


def test_a_fault_that_loses_the_gpu_stops_only_this_process_parts(tmp_path, stubbed, monkeypatch):
    """A kernel fault (an illegal address, say) leaves the process's CUDA context unusable: the checks and
    timings after it are not run, the fairseq runs (processes of their own) go on, and the run fails."""
    def check(L, dtype, causal, gates, D=64):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu, "check", check)
    monkeypatch.setattr(gpu, "cuda_lost", lambda: "AcceleratorError('illegal memory access')")
    monkeypatch.setattr(gpu, "measure", lambda *a: pytest.fail("timed on a lost GPU"))
    assert gpu.main(["--out", str(tmp_path), "--lengths", "1024", "--check-lengths", "1"]) == 1
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert "illegal memory access" in report["check"][0]["error"]
    assert all(c["error"] == "not run: CUDA context lost" for c in report["check"][1:])
    assert [c["gates"] for c in report["check"][-3:]] == [gpu.FEATURE_MAP] * 3 and not [
        c for c in stubbed if c[0] == "feature map"]
    assert report["timing"][0]["results"]["sdpa"]["fwd_ms"] == "not run: CUDA context lost"
    assert len([c for c in stubbed if c[0] == "train"]) == 13 and ("eval_lm", 512) in stubbed
    assert ("decoding",) not in stubbed and report["decoding"]["error"].startswith("not run")
    assert "became unusable in the benchmark's process** (after the check at L = 1" in (tmp_path / "gpu.md").read_text()


def test_a_fault_while_timing_stops_the_timings_after_it(tmp_path, stubbed, monkeypatch):
    monkeypatch.setattr(gpu, "check", lambda L, dt, causal, gates, D=64: {"L": L, "dtype": dt, "causal": causal,
                                                                     "gates": gates, "ok": True, "finite": True,
                                                                     "errors": {"values": 0.0, "dv": 0.0}})
    monkeypatch.setattr(gpu, "cuda_lost", lambda: "AcceleratorError('illegal memory access')")

    def measure(impl, *a):
        stubbed.append(("measure", impl))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu, "measure", measure)
    monkeypatch.setattr(gpu, "measure_feature_map", lambda *a: pytest.fail("timed on a lost GPU"))
    assert gpu.main(["--out", str(tmp_path), "--lengths", "1024,2048", "--check-lengths", "1"]) == 1
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [c for c in stubbed if c[0] == "measure"] == [("measure", gpu.IMPLS[0])]
    results = [r["results"] for r in report["timing"]]
    assert "illegal memory access" in results[0][gpu.IMPLS[0]]["fwd_ms"]
    assert all(results[1][i]["fwd_ms"] == "not run: CUDA context lost" for i in gpu.IMPLS)
    assert report["cuda_lost"].startswith(f"after {gpu.IMPLS[0]} at L = 1024")
    assert len([c for c in stubbed if c[0] == "train"]) == 13 and ("decoding",) not in stubbed


def test_tune_run_writes_its_table_at_each_length(tmp_path, stubbed, monkeypatch):
    def sweep(L, B, H, D, warmup, iters, over, record):
        record({"L": L, "B": B, "pass": "shipped", "forward": [32, 8], "backward": [16, 8], "programs": 4,
                "stages": [3, 3], "prefetch": [False, False], "fused": True, "chunk": 32, "segments": 1, "ok": True, "errors": {"values": 0.0, "dq": 0.0},
                "ms": 1.0})

    monkeypatch.setattr(gpu_tune, "sweep", sweep)
    assert gpu.main(["--out", str(tmp_path), "--tune", "--tune-lengths", "1024,4096"]) == 0
    md = (tmp_path / "tune.md").read_text()
    assert "| 1024 | 32 | shipped | (32, 8) | (16, 8) | 4 | (3, 3) | (False, False) | True | 1 | 1.000 |" in md and "| 4096 | 8 | shipped |" in md
    assert not (tmp_path / "gpu.md").exists() and not [c for c in stubbed if c[0] == "train"]
