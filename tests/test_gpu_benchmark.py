"""``python -m lion_fairseq.benchmark.gpu`` on CPU, so that a lent GPU's minutes go to the GPU: each of its
parts run here at tiny size (the kernel under Triton's interpreter, fairseq in float32 with ``cpu: true``),
and its report written from a made-up result with every kind of cell."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
    # float32 (products in float32 on both sides: the tightest tolerance) at every L, each way
    assert {(c[0], c[2]) for c in cases if c[1] == "float32"} == {(L, ca) for L in (1, 1000) for ca in (False, True)}
    assert {(c[1], c[2], c[3]) for c in cases if c[4] == 128} == {("bfloat16", False, g) for g in gpu.GATES} | {
        ("bfloat16", True, "token"), ("float16", False, "token")}


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
def test_speed_run_eval_lm_and_recurrent_decoding(tmp_path, one_thread, monkeypatch):
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
    clock = iter([0.0, 2.0])  # the generation's start and end: 2 s for 8 tokens
    monkeypatch.setattr(gpu_training, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    dec = gpu_training.recurrent_decoding(Path(lm["checkpoint"]), device="cpu", prompt_tokens=20, new_tokens=8)
    assert dec["new_tokens"] == 8 and dec["agree"] == 8 and dec["ms_per_token"] == 250.0, dec


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
    tables = {t.split("\n")[0]: t for t in md.split("### ")[1:]}
    assert "| 1024 | 32 | 1.5 | - |" in tables["forward+backward, ms"]
    assert "| 1024 | 32 | 10 | - |" in tables["forward peak, MiB"] and "| 1024 | 32 | 40 | - |" in tables["forward+backward peak, MiB"]
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


def _ok_check(seen=None):
    """A stand-in for ``gpu.check`` that finds the kernel right (each case's head size into ``seen``)."""
    def check(L, dt, causal, gates, D=64):
        if seen is not None:
            seen.append(D)
        return {"L": L, "dtype": dt, "causal": causal, "gates": gates, "D": D, "ok": True, "finite": True,
                "errors": {"values": 0.0, "dv": 0.0}}
    return check


def test_main_evaluates_the_forms_as_soon_as_the_checkpoint_exists(tmp_path, stubbed, monkeypatch):
    monkeypatch.setattr(gpu, "check", _ok_check())
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
    monkeypatch.setattr(gpu, "check", _ok_check())
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


# ---- the check's verdict, the figures, the budget and the saving, on stand-ins (no kernel run) ----


class _ReadsDyReversed(torch.autograd.Function):
    """Identity forward; a backward that reads dy along D reversed (a wrong stride): only a loss with
    unequal weights along D can see it."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy.flip(-1)


@pytest.fixture
def wrong_kernel(monkeypatch):
    """``backend="triton"`` replaced by the PyTorch form made wrong as ``wrong`` says: ``{"where": "values" or
    an input's name or "dy", "by": relative error}``; each call's (backend, causal, dtype, D) in ``calls``."""
    from lion_fairseq import ops

    real, wrong, calls = ops.lion_attention, {}, []

    def lion_attention(q, k, v, f, b, *, form, causal=False, backend):
        calls.append((backend, causal, q.dtype, q.shape[-1]))
        where, by = wrong.get("where"), wrong.get("by", 0.0) if backend == "triton" else 0.0
        named = dict(zip(gpu.INPUT_NAMES, (q, k, v, f, b)))
        if by and where in named:
            named[where].register_hook(lambda g: (g.double() * (1 + by)).to(g.dtype))
        y = real(q, k, v, f, b, form=form, causal=causal, backend="torch")
        if by and where == "values":
            y = (y.double() * (1 + by)).to(y.dtype)
        return _ReadsDyReversed.apply(y) if by and where == "dy" else y

    monkeypatch.setattr(ops, "lion_attention", lion_attention)
    return SimpleNamespace(wrong=wrong, calls=calls)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("where", ["values", "q", "k", "v", "log_a_fwd", "log_a_bwd"])
def test_check_passes_half_its_tolerance_and_fails_twice_it(wrong_kernel, dtype, where):
    """Each value and gradient is held to its own dtype's tolerance, on its own: an error of half of it
    passes (the same rounding on both sides would not cost a GPU run), of twice it fails the check."""
    tol = gpu.TOLERANCE[dtype]["values" if where == "values" else "grads"]
    for by, ok in ((tol / 2, True), (2 * tol, False)):
        wrong_kernel.wrong.update(where=where, by=by)
        c = gpu.check(33, dtype, False, "token", device="cpu", B=1, H=2, D=16)
        assert c["ok"] is ok and c["finite"], (by, c)
        assert c["errors"]["values" if where == "values" else f"d{where}"] == pytest.approx(by, rel=0.3), c


@pytest.mark.parametrize("dtype,by", [("float32", 1e-3), ("bfloat16", 0.1), ("float16", 0.1)])
def test_check_fails_a_miscompiled_kernel(wrong_kernel, dtype, by):
    """What a miscompiled kernel gives: 0.1% in float32, 10% in 16 bits, in any one gradient; and a backward
    that reads dy along D reversed, which only the check's random weights along D show."""
    for where in ("values", "q", "log_a_bwd"):
        wrong_kernel.wrong.update(where=where, by=by)
        assert not gpu.check(33, dtype, False, "token", device="cpu", B=1, H=2, D=16)["ok"], where
    wrong_kernel.wrong.update(where="dy", by=1.0)
    assert not gpu.check(33, dtype, False, "head", device="cpu", B=1, H=2, D=16)["ok"]


def test_check_runs_the_kernel_in_the_case_it_names(wrong_kernel):
    wrong_kernel.wrong.clear()
    c = gpu.check(33, "float16", True, "token", device="cpu", B=1, H=2, D=16)
    assert c["ok"] and all(e == 0.0 for e in c["errors"].values()), c
    assert sorted(wrong_kernel.calls, key=str) == [("torch", True, torch.float16, 16), ("triton", True, torch.float16, 16)]


def test_check_feature_map_fails_a_wrong_kernel(monkeypatch):
    from lion_fairseq.modules.feature_maps import silu_norm
    from lion_fairseq.ops import feature_kernel

    monkeypatch.setattr(feature_kernel, "silu_norm_kernel", lambda x: silu_norm(x) * 1.05)
    c = gpu.check_feature_map(40, "float32", device="cpu", B=2, H=3, D=32)
    assert not c["ok"] and c["errors"]["values"] == pytest.approx(0.05, rel=1e-3), c


def test_measure_reports_the_rates_its_time_and_kernel_cost_imply(monkeypatch):
    costs = []
    monkeypatch.setattr(gpu, "time_ms", lambda fn, warmup, iters, device: 2.0)
    monkeypatch.setattr(gpu, "peak_mib", lambda fn, device: 7.0)
    monkeypatch.setattr(gpu, "kernel_cost", lambda B, H, L, D, gates, mode, **kw: costs.append(
        (B, H, L, D, gates, mode)) or {"flops": 3e9 if mode == "fwd" else 5e9, "bytes": 4e9})
    r = gpu.measure("lion-d-triton", 1, 2, 40, 16, warmup=0, iters=1, device="cpu")
    # 3e9 FLOPs in 2 ms: 1.5 TFLOP/s; 4e9 bytes in 2 ms: 2000 GB/s
    assert r == pytest.approx({"fwd_ms": 2.0, "fwd_mib": 7.0, "fwd_tflops": 1.5, "fwd_gbps": 2000.0, "fwdbwd_ms": 2.0,
                               "fwdbwd_mib": 7.0, "fwdbwd_tflops": 2.5, "fwdbwd_gbps": 2000.0})
    assert costs == [(1, 2, 40, 16, "head", "fwd"), (1, 2, 40, 16, "head", "fwdbwd")]


def test_peak_memory_is_counted_above_the_inputs(monkeypatch):
    peak = {"MiB": 100}  # an earlier call's peak, until the stats are reset
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 10 * 2 ** 20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: peak.update(MiB=10))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peak["MiB"] * 2 ** 20)
    assert gpu.peak_mib(lambda: peak.update(MiB=max(peak["MiB"], 25)), device="cuda") == 15.0


def test_time_ms_is_the_median_after_the_warm_up(monkeypatch):
    clock = [0.0]
    seconds = iter([10.0, 10.0, 0.001, 0.005, 0.002])  # two warm-up calls (Triton compiling), three timed

    def fn():
        clock[0] += next(seconds)

    monkeypatch.setattr(gpu, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert gpu.time_ms(fn, warmup=2, iters=3, device="cpu") == pytest.approx(2.0)


def test_the_forward_is_timed_without_autograd():
    modes, x = [], torch.randn(3, requires_grad=True)
    calls = gpu.timed_calls(lambda a, b: modes.append(torch.is_grad_enabled()) or a * 2, [x, None], torch.ones(3))
    calls["fwd"]()
    assert modes == [False] and x.grad is None
    calls["fwdbwd"]()
    calls["fwdbwd"]()  # each timed backward starts from no gradient, not adding to the last one's
    assert modes == [False, True, True] and torch.equal(x.grad, torch.full((3,), 2.0))


def test_a_check_out_of_tolerance_fails_the_run(tmp_path, stubbed, monkeypatch):
    """No exception, only an error over the tolerance: the run still fails and the table says NO."""
    def check(L, dt, causal, gates, D=64):
        return {"L": L, "dtype": dt, "causal": causal, "gates": gates, "D": D, "finite": True,
                "ok": not (dt == "float16" and gates == "token"), "errors": {"values": 0.5, "dv": 0.5}}

    monkeypatch.setattr(gpu, "check", check)
    assert gpu.main(["--out", str(tmp_path), "--check-lengths", "1", "--budget-s=-1"]) == 1
    assert "| 1 | float16 | False | token | 64 | 5.00e-01 | dv 5.00e-01 | NO |" in (tmp_path / "gpu.md").read_text()


def test_past_the_budget_only_the_check_runs(tmp_path, stubbed, monkeypatch):
    """Every check runs, at both head sizes; every timing, training and evaluation after it is recorded as
    skipped, which does not fail the run."""
    sizes = []
    monkeypatch.setattr(gpu, "check", _ok_check(sizes))
    monkeypatch.setattr(gpu, "measure", lambda *a: pytest.fail("timed past the budget"))
    monkeypatch.setattr(gpu, "measure_feature_map", lambda *a: pytest.fail("timed past the budget"))
    monkeypatch.setattr(gpu, "train_and_evaluate", lambda *a: pytest.fail("trained past the budget"))
    assert gpu.main(["--out", str(tmp_path), "--lengths", "1024", "--check-lengths", "1,1000", "--budget-s=-1",
                     "--precision-table", "--mixed-precision-runs"]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())  # what was skipped is saved too
    assert len(report["check"]) == len(gpu.check_cases([1, 1000])) + 3 and sorted(set(sizes)) == [64, 128]
    assert all(r["fwd_ms"] == "skipped (budget)" for r in report["timing"][0]["results"].values())
    assert all(r["error"] == "skipped (budget)" for r in report["speed"] + report["train"]) and len(report["train"]) == 9
    assert not {"feature_map", "precision", "precision_error", "eval_lm"} & set(report)
    assert not [c for c in stubbed if c[0] in ("train", "eval_lm")]


def test_main_saves_after_every_measurement(tmp_path, stubbed, monkeypatch):
    """A run cut short keeps all it measured: each stand-in finds every result before it in gpu.json."""
    saved = lambda: json.loads((tmp_path / "gpu.json").read_text()) if (tmp_path / "gpu.json").exists() else None  # noqa: E731
    found = []
    ok = _ok_check()
    monkeypatch.setattr(gpu, "check", lambda *a, **kw: found.append(("check", len((saved() or {"check": []})["check"])))
                        or ok(*a, **kw))
    monkeypatch.setattr(gpu, "measure", lambda impl, *a: found.append(
        ("measure", sum(len(row["results"]) for row in saved()["timing"]))) or {"fwd_ms": 1.0})
    train = gpu.train_speed
    monkeypatch.setattr(gpu, "train_speed", lambda *a, **kw: found.append(
        ("train", len(saved()["speed"]), "eval_lm" in saved(), "decoding" in saved())) or train(*a, **kw))
    assert gpu.main(["--out", str(tmp_path), "--lengths", "1024", "--check-lengths", "1",
                     "--train-lengths", "512,2048"]) == 0
    checks = [f[1] for f in found if f[0] == "check"]
    assert checks == list(range(len(checks))) and len(checks) == len(gpu.check_cases([1]))
    assert [f[1] for f in found if f[0] == "measure"] == list(range(len(gpu.IMPLS)))
    trains = [f[1:] for f in found if f[0] == "train"]
    assert trains == [(i, i > 1, i > 1) for i in range(len(trains))] and len(trains) == 9


def test_main_publishes_each_lion_run_against_its_softmax_model(tmp_path, stubbed, monkeypatch):
    wps = {"transformer_lm": 100.0, "lion_s_lm": 150.0, "roberta_base": 80.0, "lion_s": 40.0}
    measured = []
    monkeypatch.setattr(gpu, "check", _ok_check())
    monkeypatch.setattr(gpu, "measure", lambda *a: measured.append(a) or {"fwd_ms": 1.0})
    monkeypatch.setattr(gpu, "train_speed", lambda root, task, arch, L, backend, **kw: {
        "task": task, "arch": arch, "backend": backend, "L": L, "B": 1, "wps": wps[arch], "seconds": 1.0})
    assert gpu.main(["--out", str(tmp_path), "--lengths", "1024,4096", "--check-lengths", "1", "--tokens", "8192",
                     "--heads", "6", "--dim", "32", "--warmup", "2", "--iters", "5", "--train-lengths", "512"]) == 0
    assert {a[1:] for a in measured} == {(8, 6, 1024, 32, 2, 5), (2, 6, 4096, 32, 2, 5)}
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [row["B"] for row in report["timing"]] == [8, 2]
    assert [(r["arch"], r["backend"], r.get("vs_softmax")) for r in report["speed"]] == [
        ("transformer_lm", None, None), ("lion_s_lm", "triton", 1.5), ("roberta_base", None, None),
        ("lion_s", "triton", 0.5), ("lion_s_lm", "fla", 1.5)]


@pytest.mark.parametrize("missing", [None, "fla is not installed"])
def test_fla_is_run_only_where_it_can_run(tmp_path, stubbed, monkeypatch, missing):
    evaluated = []
    monkeypatch.setattr(gpu, "fla_missing", lambda: missing)
    monkeypatch.setattr(gpu, "check", _ok_check())
    monkeypatch.setattr(gpu, "measure", lambda *a: {"fwd_ms": 1.0})
    monkeypatch.setattr(gpu, "eval_lm_forms", lambda ckpt, L, forms: evaluated.extend(forms) or {f: {"loss": 1.0} for f in forms})
    assert gpu.main(["--out", str(tmp_path), "--lengths", "1024", "--check-lengths", "1", "--train-lengths", "512"]) == 0
    fla = [c for c in stubbed if c[0] == "train" and c[2] == "fla"]
    assert (len(fla), "chunk-fla" in evaluated) == ((1, True) if missing is None else (0, False)), evaluated


@pytest.mark.parametrize("dtype,where,by", [("bfloat16", "log_a_bwd", 0.1), ("float16", "values", 6e-3)])
def test_tune_candidate_that_disagrees_is_reported_not_timed(wrong_kernel, dtype, where, by):
    """A fast configuration that is wrong must not be chosen: its row has no time. In fp16, fp16's own
    tolerances (0.6% in the values would pass bf16's)."""
    inputs = gpu.make_inputs(1, 2, 40, 16, getattr(torch, dtype), "token", grad=True, device="cpu")
    weight = torch.randn(1, 2, 40, 16)
    ref = gpu.outputs(inputs, weight, "torch", False)
    wrong_kernel.wrong.clear()
    assert gpu_tune.candidate(inputs, weight, ref, "fwd", 0, 1, "cpu", dtype)["ms"] > 0
    wrong_kernel.wrong.update(where=where, by=by)
    row = gpu_tune.candidate(inputs, weight, ref, "fwd", 0, 1, "cpu", dtype)
    assert not row["ok"] and "ms" not in row, row


def test_tune_sweep_chooses_each_pass_from_the_last_ones_fastest(monkeypatch):
    """Each candidate's time made up from the configuration in force, so that every pass's fastest differs
    from the shipped one and from its neighbour's: each pass must take the choices of those before it."""
    from lion_fairseq.ops import kernel

    def ms(mode):
        f, b, p = kernel.BLOCKS[False][64], kernel.BLOCKS[True][64], kernel.PROGRAMS_PER_SM
        t = {(16, 4): 0, (32, 8): 5}[f] + ({2: 0, 4: 1, 8: 3} if mode == "fwd" else {2: 3, 4: 1, 8: 0})[p]
        if mode == "fwd":
            return t + {1: 2, 2: 0, 3: 1}[kernel.STAGES[False]] + (0 if kernel.PREFETCH[False] else 1)
        return t + {(16, 4): 0, (16, 8): 2}[b] + (0 if not kernel.FUSED[64] else 1) + {1: 0, 2: 2, 3: 1}[kernel.STAGES[True]]

    seen = []

    def candidate(inputs, weight, ref, mode, warmup, iters, device, dtype_name="bfloat16"):
        seen.append((mode, dtype_name, inputs[0].dtype))
        return {"chunk": 16, "segments": 1, "ok": True, "finite": True, "errors": {"values": 0.0}, "ms": ms(mode) + 1.0}

    monkeypatch.setattr(gpu_tune, "candidate", candidate)
    rows = []
    gpu_tune.sweep(40, 1, 2, 16, 0, 1, lambda: False, rows.append, device="cpu", forward=((16, 4), (32, 8)),
                   backward=((16, 4), (16, 8)), programs=(2, 8), stages=(1, 2))
    got = [(r["pass"], tuple(r["forward"]), tuple(r["backward"]), r["programs"], tuple(r["stages"]),
            tuple(r["prefetch"]), r["fused"]) + s[:2] for r, s in zip(rows, seen)]
    F, B16 = (16, 4), (16, 4)  # the fastest forward and backward blocks; shipped: (32, 8) and (16, 8)
    ship = ((3, 3), (False, False), True)
    bf, fp = ("fwd", "bfloat16"), ("fwdbwd", "bfloat16")
    assert got == [("forward", c, (16, 8), p) + ship + bf for p in (2, 8) for c in ((16, 4), (32, 8))] + [
        ("shipped", (32, 8), (16, 8), 4) + ship + fp] + [
        ("backward", F, c, p) + ship + fp for p in (2, 8) for c in ((16, 4), (16, 8))] + [
        ("backward fused", F, c, 8, (3, 3), (False, False), u) + fp for u in (False, True) for c in ((16, 4), (16, 8))] + [
        ("backward fused fp16", F, B16, 8, (3, 3), (False, False), u, "fwdbwd", "float16") for u in (False, True)] + [
        ("forward stages", F, (16, 8), 2, (n, 3), (False, False), True) + bf for n in (1, 2)] + [
        ("backward stages", F, B16, 8, (2, n), (False, False), False) + fp for n in (1, 2)] + [
        ("forward prefetch", F, (16, 8), 2, (2, 3), (a, False), True) + bf for a in (False, True)] + [
        ("backward prefetch", F, B16, 8, (2, 1), (True, a), False) + fp for a in (False, True)]
    assert [s[2] for s in seen if s[1] == "float16"] == [torch.float16] * 2
    rows.clear()
    gpu_tune.sweep(40, 1, 2, 16, 0, 1, lambda: True, rows.append, device="cpu", forward=((16, 4),), backward=((16, 4),),
                   programs=(2,), stages=(1,))
    assert len(rows) == len(got) - 10 and all(r["skipped"] == "budget" for r in rows) and len(seen) == len(got)


def test_tune_best_rows_are_the_fastest_that_agree():
    rows = [{"L": 1024, "pass": "forward", "ms": 2.0, "forward": [16, 4]}, {"L": 1024, "pass": "forward", "ms": 1.0,
            "forward": [32, 8]}, {"L": 1024, "pass": "forward", "ok": False, "forward": [64, 4]},
            {"L": 1024, "pass": "forward", "ms": 3.0, "forward": [64, 8]}, {"L": 4096, "pass": "forward", "ms": 5.0,
            "forward": [16, 4]}]
    assert [(r["L"], r["forward"]) for r in gpu_tune.best_rows(rows)] == [(1024, [32, 8]), (4096, [16, 4])]


def test_tune_run_fails_on_a_wrong_candidate_and_saves_each_row(tmp_path, stubbed, monkeypatch):
    row = {"pass": "shipped", "forward": [32, 8], "backward": [16, 8], "programs": 4, "stages": [3, 3],
           "prefetch": [False, False], "fused": True, "chunk": 32, "segments": 1, "errors": {"values": 0.5, "dq": 0.5}}

    saved = []

    def sweep(L, B, H, D, warmup, iters, over, record):
        if L == 4096:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        record(dict(row, L=L, B=B, ok=False))
        saved.append(json.loads((tmp_path / "tune.json").read_text())["rows"] if (tmp_path / "tune.json").exists() else None)

    monkeypatch.setattr(gpu_tune, "sweep", sweep)
    assert gpu.main(["--out", str(tmp_path), "--tune", "--tune-lengths", "1024"]) == 1
    assert [[r["ok"] for r in rows] for rows in saved] == [[False]]  # written as soon as recorded
    assert gpu.main(["--out", str(tmp_path / "b"), "--tune", "--tune-lengths", "4096"]) == 1
    assert "Stopped at L = 4096: RuntimeError" in (tmp_path / "b" / "tune.md").read_text()


def _fake_fairseq(monkeypatch, log, code=0):
    """gpu_training's fairseq commands replaced: each returns ``log`` and ``code`` and records its argv,
    LION_BACKEND and its hydra config (where it has one)."""
    runs = []

    def run(argv, capture_output, text, env):
        config = Path(argv[argv.index("--config-dir") + 1]) / "speed.yaml" if "--config-dir" in argv else None
        runs.append(SimpleNamespace(argv=argv, backend=env.get("LION_BACKEND"),
                                    config=config.read_text() if config and config.exists() else ""))
        return subprocess.CompletedProcess(argv, code, log, "")

    monkeypatch.setattr(gpu_training, "prepare_data", lambda root: root / "data-bin")
    monkeypatch.setattr(gpu_training, "subprocess", SimpleNamespace(run=run))
    return runs


def _train_log(wps):
    return "".join(f'[train_inner][INFO] - {{"loss": "{9 - u}", "wps": "{w}"}}\n' for u, w in enumerate(wps))


def test_train_speed_is_fairseqs_median_wps_after_three_updates(tmp_path, monkeypatch):
    monkeypatch.setenv("LION_BACKEND", "torch")
    runs = _fake_fairseq(monkeypatch, _train_log([5.0, 50.0, 60.0, 100.0, 300.0, 200.0]))  # 3: Triton compiling
    r = gpu_training.train_speed(tmp_path, "mlm", "lion_s", 2048, "fla", tokens=8192, updates=6, keep_checkpoint=True)
    assert (r["wps"], r["B"], r["losses"]) == (200.0, 4, [9.0, 8.0, 7.0, 6.0, 5.0, 4.0]) and "error" not in r, r
    assert r["checkpoint"].endswith("checkpoint_last.pt")
    assert runs[0].backend == "fla" and "bf16: true" in runs[0].config and "max_positions: 2048" in runs[0].config
    gpu_training.train_speed(tmp_path, "lm", "transformer_lm", 512, None, tokens=8192, updates=6)
    assert runs[1].backend is None and "batch_size: 16" in runs[1].config and "no_save: true" in runs[1].config


@pytest.mark.parametrize("wps,code", [([5.0, 50.0, 60.0], 0), ([5.0, 50.0, 60.0, 100.0], 1)])
def test_train_speed_without_a_figure_is_an_error(tmp_path, monkeypatch, wps, code):
    _fake_fairseq(monkeypatch, _train_log(wps), code)
    r = gpu_training.train_speed(tmp_path, "lm", "lion_s_lm", 512, "triton", keep_checkpoint=True)
    assert "error" in r and "checkpoint" not in r, r


def test_eval_lm_forms_runs_each_form_on_its_backend(tmp_path, monkeypatch):
    runs = _fake_fairseq(monkeypatch, "| Loss (base 2): 3.5000, Perplexity: 11.31\n")
    out = gpu_training.eval_lm_forms(tmp_path / "run" / "checkpoint_last.pt", 512,
                                     forms=("parallel", "chunk-triton", "chunk-fla", "recurrent"))
    assert [(r.argv[r.argv.index("--model-overrides") + 1], r.backend) for r in runs] == [
        (repr({"lion_form": f}), b) for f, b in (("parallel", "torch"), ("chunk", "triton"), ("chunk", "fla"),
                                                 ("recurrent", "torch"))]
    assert out["chunk-triton"] == {"loss": 3.5, "ppl": 11.31}
    _fake_fairseq(monkeypatch, "| Loss (base 2): 3.5000, Perplexity: 11.31\n", code=1)
    assert "error" in gpu_training.eval_lm_forms(tmp_path / "run" / "checkpoint_last.pt", 512, forms=("parallel",))["parallel"]


def test_lion_backend_restores_an_unset_variable(monkeypatch):
    monkeypatch.delenv("LION_BACKEND", raising=False)
    with gpu_training.lion_backend("triton"):
        assert os.environ["LION_BACKEND"] == "triton"
    assert "LION_BACKEND" not in os.environ


def test_train_and_evaluate_needs_every_update_and_the_forms_within_1e_3(tmp_path, monkeypatch):
    _fake_fairseq(monkeypatch, _train_log([1.0] * 3))
    (tmp_path / "s-fp16").mkdir()
    (tmp_path / "s-fp16" / "checkpoint_last.pt").write_text("")
    forms = dict.fromkeys(gpu_training.FORMS, 5.0)
    monkeypatch.setattr(gpu_training, "form_losses", lambda ckpt, data, length, device: dict(forms))
    assert gpu_training.train_and_evaluate(tmp_path, "s", "fp16", updates=3)["ok"]
    assert not gpu_training.train_and_evaluate(tmp_path, "s", "fp16", updates=4)["ok"]  # an update missing
    forms["recurrent"] = 5.0 * (1 + 2e-3)
    row = gpu_training.train_and_evaluate(tmp_path, "s", "fp16", updates=3)
    assert not row["forms_agree"] and not row["ok"], row


def test_form_losses_runs_each_chunk_form_on_its_backend(tmp_path, monkeypatch):
    from fairseq import checkpoint_utils

    backends = []

    class Model(torch.nn.Module):
        def forward(self, source):
            backends.append(os.environ.get("LION_BACKEND"))
            return (torch.zeros(1, source.shape[1], 5),)

    item = {"source": torch.zeros(3, dtype=torch.long), "target": torch.zeros(3, dtype=torch.long)}
    task = SimpleNamespace(load_dataset=lambda split: None, dataset=lambda split: [item])
    monkeypatch.setattr(checkpoint_utils, "load_model_ensemble_and_task", lambda paths, arg_overrides: ([Model()], None, task))
    monkeypatch.delenv("LION_BACKEND", raising=False)
    assert set(gpu_training.form_losses(tmp_path / "checkpoint_last.pt", tmp_path, 3, "cpu")) == set(gpu_training.FORMS)
    assert backends == ["torch", "triton", "fla", "torch", "torch"]  # FORMS' order; torch where none is named
