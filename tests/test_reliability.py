"""Reliability, tried as a user would: a run killed with SIGKILL and restarted, fairseq's own distributed
training on two CPU processes, bf16/fp16 at L = 4096, broken or foreign checkpoints, and bad input
(empty split, wrong dictionary, too long for learned positions, bad options, huge chunks, NaN gates).

Every fairseq command runs on one thread (the box is small and shared); processes that do not depend on
each other run side by side.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

import lion_fairseq  # noqa: F401  (registers the models and installs the clear errors, as --user-dir does)
from conftest import ROOT, USER_DIR, build_model as build, fairseq_cli, training_args
from lion_fairseq import check_checkpoint, clear_errors

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
COMMON = ["--user-dir", USER_DIR, "--cpu", "--num-workers", "0", "--tokens-per-sample", "32", "--optimizer", "adam",
          "--log-format", "json", "--log-interval", "1", "--no-progress-bar", "--disable-validation",
          "--no-epoch-checkpoints", "--lion-chunk-size", "8"]
TASKS = {  # one LM (LION-S, causal) and one MLM (LION-D, bidirectional)
    "lm": ["--task", "language_modeling", "--arch", "lion_s_lm_tiny", "--criterion", "cross_entropy",
           "--lr", "0.003", "--seed", "3"],
    "mlm": ["--task", "masked_lm", "--arch", "lion_d_tiny", "--criterion", "masked_lm", "--lr", "0.001",
            "--seed", "1"],
}


# fairseq-train on one thread: on a busy 2-core machine a second thread makes it several times slower
pytestmark = pytest.mark.usefixtures("one_thread")


def start(data: Path, args: List[str], log: Path, module: str = "train", command: Optional[List[str]] = None,
          ) -> subprocess.Popen:
    """``python -m fairseq_cli.<module> data args`` (or ``command data args``) in the background, in the
    checkout, stdout+stderr to ``log``."""
    command = command or [sys.executable, "-m", f"fairseq_cli.{module}"]
    with open(log, "w") as out:
        return subprocess.Popen([*command, *([str(data)] if data else []), *args], env=ENV, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)


def finish(procs: Dict[str, subprocess.Popen], logs: Dict[str, Path], timeout: float = 600) -> Dict[str, str]:
    out = {}
    for name, proc in procs.items():
        rc = proc.wait(timeout=timeout)
        out[name] = logs[name].read_text()
        assert rc == 0, f"{name} failed ({rc}):\n{out[name][-3000:]}"
    return out


def train_records(log: str) -> List[Dict]:
    """The train_inner records of fairseq-train (``| train_inner | {...}``; ``INFO:train_inner:{...}`` from
    the workers it spawns, which log in Python's default format) and of fairseq-hydra-train
    (``[train_inner][INFO] - {...}``)."""
    return [json.loads(m.group(1)) for m in re.finditer(r"train_inner(?: \| |\]\[INFO\] - |:)(\{.*\})", log)]


def train_losses(log: str) -> List[float]:
    return [float(r["loss"]) for r in train_records(log)]


def params(ckpt: Path) -> Dict[str, torch.Tensor]:
    return torch.load(ckpt, weights_only=True)["model"]


# ---- resume after SIGKILL, and two gloo processes: one wave of fairseq-train runs -------------------------

UPDATES, HALF = 8, 4  # an epoch of the corpus at 8 x 32 tokens is ~300 updates: HALF is mid-epoch
DDP_BACKEND = {"lm": "legacy_ddp", "mlm": "no_c10d"}  # the two names of the one DDP that runs on CPU


def free_ports(n: int) -> List[int]:
    """``n`` ports free now, all different: each socket is held until the last is bound (ports asked for one
    at a time could come back twice while the first one's rank has not yet bound it)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def base_args(task: str) -> List[str]:
    return [*COMMON, *TASKS[task], "--dropout", "0", "--batch-size", "4", "--max-update", str(UPDATES),
            "--save-interval-updates", str(HALF)]


def rank_args(task: str, rank: int, port: int) -> List[str]:
    """Rank ``rank`` of two CPU processes started by hand (gloo)."""
    return ["--distributed-world-size", "2", "--distributed-backend", "gloo", "--ddp-backend", DDP_BACKEND[task],
            "--distributed-rank", str(rank), "--distributed-init-method", f"tcp://localhost:{port}",
            "--distributed-no-spawn"]


@pytest.fixture(scope="module")
def runs(text_data_bin, tmp_path_factory):
    """Side by side, for LM and MLM (dropout 0, two batches of 4 per update):

    - ``straight``: one process, ``--update-freq 2``, UPDATES updates uninterrupted;
    - ``killed``: the same command, killed with SIGKILL once its checkpoint at HALF updates is written,
      then ``restart``: the same command again, in the same save dir;
    - ``ddp``: two processes (ranks 0 and 1), ``--distributed-world-size 2 --distributed-backend gloo
      --cpu``, one batch of 4 each per update, started by hand (``--distributed-no-spawn``;
      ``--ddp-backend c10d`` hands torch a CUDA device id, see the next tests);
    - ``spawn`` (LM): the same two ranks launched as on one multi-GPU node: one ``fairseq-train
      --distributed-world-size 2`` that spawns its workers, the machine reporting two devices
      (tests/two_devices.py), ``--user-dir`` relative to the checkout;
    - ``torchrun`` (LM): the two ranks launched by ``torchrun --nproc-per-node 2`` (``env://``), ``--user-dir``
      the path that ``lion-fairseq-user-dir`` prints.

    Returns ``{task: {"dir": {kind: save dir}, "log": {kind: text}, "rc_killed": int, "at_kill": state}}``.
    """
    root = tmp_path_factory.mktemp("runs")
    base = {t: base_args(t) for t in TASKS}
    procs, logs, out = {}, {}, {t: {"dir": {}, "log": {}} for t in TASKS}
    two_devices = [sys.executable, str(ROOT / "tests" / "two_devices.py")]
    entry_point = subprocess.run([str(Path(sys.executable).with_name("lion-fairseq-user-dir"))], capture_output=True,
                                 text=True, check=True).stdout.strip()
    ports = iter(free_ports(len(TASKS) + 1))  # each task's ranks started by hand, and torchrun's
    for t in TASKS:
        port = next(ports)
        ranks = ["--distributed-world-size", "2", "--distributed-backend", "gloo", "--ddp-backend", DDP_BACKEND[t]]
        extra = {"straight": ["--update-freq", "2"], "killed": ["--update-freq", "2"]}
        for r in (0, 1):
            extra[f"ddp{r}"] = rank_args(t, r, port)
        commands = {}
        if t == "lm":
            extra["spawn"] = [*ranks, "--user-dir", "lion_fairseq"]
            extra["torchrun"] = [*ranks, "--user-dir", entry_point]
            commands["spawn"] = two_devices
            commands["torchrun"] = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "--master-addr", "127.0.0.1", "--master-port", str(next(ports)), *two_devices[1:]]
        for kind, args in extra.items():
            save = root / f"{t}_{kind.rstrip('01')}"
            out[t]["dir"][kind.rstrip("01")] = save
            logs[t, kind] = root / f"{t}_{kind}.log"
            procs[t, kind] = start(text_data_bin, [*base[t], *args, "--save-dir", str(save)], logs[t, kind],
                                   command=commands.get(kind))
    deadline = time.time() + 600
    pending = set(TASKS)
    saved = re.compile(rf"Saved checkpoint .*\(epoch 1 @ {HALF} updates")
    while pending and time.time() < deadline:  # kill -9 as soon as the HALF checkpoint is written
        for t in list(pending):
            if saved.search(logs[t, "killed"].read_text()):
                procs[t, "killed"].send_signal(signal.SIGKILL)
                procs[t, "killed"].wait()
                out[t]["rc_killed"] = procs[t, "killed"].returncode
                out[t]["log"]["killed"] = logs[t, "killed"].read_text()
                out[t]["at_kill"] = torch.load(out[t]["dir"]["killed"] / "checkpoint_last.pt", weights_only=True)
                pending.discard(t)
            elif procs[t, "killed"].poll() is not None:
                pytest.fail(f"{t}: the run ended before it could be killed:\n{logs[t, 'killed'].read_text()[-3000:]}")
        time.sleep(0.05)
    assert not pending, "no checkpoint appeared"
    others = {key: p for key, p in procs.items() if key[1] != "killed"}
    done = finish(others, {key: logs[key] for key in others})
    for (t, kind), text in done.items():
        out[t]["log"][kind] = text
    restart = {t: root / f"{t}_restart.log" for t in TASKS}
    done = finish({t: start(text_data_bin, [*base[t], "--update-freq", "2", "--save-dir", str(out[t]["dir"]["killed"])],
                            restart[t]) for t in TASKS}, restart)
    for t in TASKS:
        out[t]["log"]["restart"] = done[t]
    return out


@pytest.mark.parametrize("task", list(TASKS))
def test_sigkill_mid_epoch_then_same_command_reaches_the_same_parameters(runs, task):
    run = runs[task]
    assert run["rc_killed"] == -signal.SIGKILL and "done training" not in run["log"]["killed"]
    at_kill = run["at_kill"]  # what the killed run left: its mid-epoch checkpoint
    assert at_kill["extra_state"]["train_iterator"]["iterations_in_epoch"] == 2 * HALF  # 2 batches per update
    assert at_kill["optimizer_history"][-1]["num_updates"] == HALF
    # the restart said where it resumed from, and ran the remaining updates only
    restart, straight = run["log"]["restart"], run["log"]["straight"]
    assert re.search(rf"Loaded checkpoint .*checkpoint_last\.pt \(epoch 1 @ {HALF} updates\)", restart), restart[-2000:]
    assert len(train_losses(restart)) == UPDATES - HALF
    assert train_losses(restart) == train_losses(straight)[HALF:]
    a, b = params(run["dir"]["killed"] / "checkpoint_last.pt"), params(run["dir"]["straight"] / "checkpoint_last.pt")
    assert a.keys() == b.keys()
    for name in b:
        assert torch.equal(a[name], b[name]), name
    # the check has teeth: the second half moved the weights
    name = next(n for n in b if n.endswith("layers.0.fc1.weight"))
    assert not torch.equal(at_kill["model"][name], b[name])


def test_two_gloo_processes_resume_mid_epoch_to_the_same_parameters(runs, text_data_bin, tmp_path):
    """Two ranks restarted from the two-rank run's checkpoint at HALF updates end where that run ended. Rank 0
    reads the checkpoint and broadcasts it, and under torch's weights_only default the other rank failed to
    load what it received (an omegaconf config): no multi-process run could resume."""
    import shutil

    ddp = runs["lm"]["dir"]["ddp"]
    shutil.copy(ddp / f"checkpoint_1_{HALF}.pt", tmp_path / "checkpoint_last.pt")
    port, = free_ports(1)
    logs = {r: tmp_path / f"rank{r}.log" for r in (0, 1)}
    out = finish({r: start(text_data_bin, [*base_args("lm"), *rank_args("lm", r, port), "--save-dir", str(tmp_path)],
                           logs[r]) for r in (0, 1)}, logs)
    assert re.search(rf"Loaded checkpoint .*\(epoch 1 @ {HALF} updates\)", out[0]), out[0][-2000:]
    assert train_losses(out[0]) == train_losses(runs["lm"]["log"]["ddp0"])[HALF:]
    a, b = params(tmp_path / "checkpoint_last.pt"), params(ddp / "checkpoint_last.pt")
    for name in b:
        assert torch.equal(a[name], b[name]), name


def test_a_finished_run_started_again_trains_nothing_and_keeps_its_checkpoints(runs, text_data_bin, tmp_path):
    """The finished run's command again (a recipe rerun): fairseq checks --max-update only after an update, so
    it trained one more and saved over checkpoint_last.pt and checkpoint_best.pt. It ends at once, status 0."""
    import shutil

    save = tmp_path / "run"
    shutil.copytree(runs["lm"]["dir"]["straight"], save)
    before = {p.name: p.read_bytes() for p in save.glob("*.pt")}
    log = tmp_path / "again.log"
    out = finish({"again": start(text_data_bin, [*base_args("lm"), "--update-freq", "2", "--save-dir", str(save)],
                                 log)}, {"again": log})["again"]
    assert f"checkpoint_last.pt is at {UPDATES} updates and --max-update is {UPDATES}: this run has finished" in out, \
        out[-2000:]
    assert train_losses(out) == [] and {p.name: p.read_bytes() for p in save.glob("*.pt")} == before


@pytest.mark.parametrize("task, launch", [("lm", "ddp"), ("mlm", "ddp"), ("lm", "spawn"), ("lm", "torchrun")])
def test_two_gloo_processes_equal_one_process_with_update_freq_2(runs, task, launch):
    """Two CPU ranks with one batch each, however launched, give the losses and weights of one process with
    two batches per update (--update-freq 2)."""
    logs, one = runs[task]["log"], runs[task]["log"]["straight"]
    if launch == "ddp":  # two processes started by hand, a log each
        ddp, both = logs["ddp0"], logs["ddp0"] + logs["ddp1"]
    else:  # one command launched both ranks, which write to its log
        ddp = both = logs[launch]
    assert "distributed init (rank 0)" in both and "distributed init (rank 1)" in both, ddp[-2000:]
    records = train_records(ddp)
    assert [r["bsz"] for r in records] == ["8"] * UPDATES  # 2 ranks x 4 sentences in every update
    assert train_losses(ddp) == train_losses(one) and len(train_losses(one)) == UPDATES, (train_losses(ddp), train_losses(one))
    a, b = params(runs[task]["dir"][launch] / "checkpoint_last.pt"), params(runs[task]["dir"]["straight"] / "checkpoint_last.pt")
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=f"{task}: {name}")


BUSY_PREFETCH = """
import torch
import lion_fairseq  # as --user-dir imports it
from fairseq.data.iterators import BufferedIterator

class Batches:  # data loading slower than training: the prefetching thread is always inside a torch op
    def __len__(self):
        return 10 ** 6
    def __iter__(self):
        x = torch.randn(256, 256)
        while True:
            for _ in range(30):
                x = (x @ x).tanh()
            yield x

batches = BufferedIterator(1, Batches())  # fairseq's --data-buffer-size, here 1
next(batches)
print("first batch")
"""


def test_a_command_that_ends_while_fairseq_prefetches_exits_with_status_0():
    """fairseq's prefetching thread, ended by Python's shutdown inside a torch op, aborts the process
    ("terminate called without an active exception", status 134) after a finished run; it happened to a
    fairseq-train in this suite. With the plugin imported, the command ends with status 0."""
    proc = subprocess.run([sys.executable, "-c", BUSY_PREFETCH], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "first batch" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_exit_hook_stops_prefetching_after_the_batch_in_hand_and_gives_up_on_a_stuck_source():
    """The exit hook in process: a thread whose queue is full, waiting to put a batch, ends; one whose
    source never yields is left after the timeout, not waited on forever."""
    import threading

    from fairseq.data.iterators import BufferedIterator
    from lion_fairseq.clean_exit import finish_prefetching

    release = threading.Event()

    class Batches:  # endless, with the length fairseq's iterator asks for
        def __init__(self, stuck: bool):
            self.stuck = stuck

        def __len__(self):
            return 10 ** 6

        def __iter__(self):
            while True:
                if self.stuck:
                    release.wait()
                yield torch.ones(64, 64) @ torch.ones(64, 64)

    busy, stuck = BufferedIterator(2, Batches(False)), BufferedIterator(2, Batches(True))
    next(busy)
    while busy._queue.qsize() < 2:  # full: its thread waits to put the next batch
        time.sleep(0.01)
    stuck._create_consumer()
    started = time.monotonic()
    finish_prefetching(timeout=0.5)
    assert not busy._consumer.is_alive() and stuck._consumer.is_alive()
    assert time.monotonic() - started < 5
    release.set()  # let the stuck one finish too
    finish_prefetching(timeout=10)
    assert not stuck._consumer.is_alive()


def test_user_dir_command_prints_the_folder_without_importing_fairseq(tmp_path):
    """``--user-dir "$(lion-fairseq-user-dir)"`` (README, Install) runs before every fairseq command typed
    with it: it prints the package's folder, from any folder, without importing the package, fairseq or
    torch (they took 4-5 s here)."""
    command = Path(sys.executable).with_name("lion-fairseq-user-dir")
    installed = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}  # the installed command's, not the checkout's
    proc = subprocess.run([sys.executable, "-X", "importtime", str(command)], env=installed, cwd=tmp_path,
                          capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == USER_DIR
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "lion_fairseq_user_dir" in imported and not imported & {"lion_fairseq", "fairseq", "torch"}, imported


def test_ddp_backends_that_cannot_run_on_cpu_are_refused_with_what_to_pass(text_data_bin):
    """c10d / pytorch_ddp hand a CUDA device id to torch's DDP: refused up front, naming legacy_ddp;
    fully_sharded needs fairscale, which fairseq says."""
    from fairseq import models
    from fairseq.dataclass.configs import DistributedTrainingConfig
    from omegaconf import OmegaConf

    model = torch.nn.Linear(2, 2)
    for backend in ("c10d", "pytorch_ddp"):
        cfg = OmegaConf.structured(DistributedTrainingConfig(ddp_backend=backend))
        with pytest.raises(ValueError, match=rf"--ddp-backend {backend} does not run on CPU.*--ddp-backend legacy_ddp"):
            models.DistributedFairseqModel(cfg, model, process_group=None, device=torch.device("cpu"))
    try:
        import fairscale  # noqa: F401
    except ImportError:
        from fairseq.distributed import fsdp_enable_wrap

        cfg = OmegaConf.structured(DistributedTrainingConfig(ddp_backend="fully_sharded"))
        with pytest.raises(ImportError, match="pip install fairscale"):
            with fsdp_enable_wrap(cfg):
                pass


def last_line_of_training_with(flag: str, text_data_bin: Path, tmp_path: Path) -> str:
    """The last line fairseq-train of a tiny LION LM on CPU with ``flag`` writes to stderr, where it fails."""
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", str(text_data_bin), "--user-dir", USER_DIR,
                           "--task", "language_modeling", "--arch", "lion_s_lm_tiny", "--optimizer", "adam", "--lr",
                           "0.001", "--criterion", "cross_entropy", "--batch-size", "4", "--max-update", "1",
                           "--save-dir", str(tmp_path), "--cpu", flag], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


def test_bf16_on_fairseq_train_names_the_way_that_works(text_data_bin, tmp_path):
    """fairseq-train --bf16 turns on fairseq's TPU code and failed in the trainer with "'NoneType' object has
    no attribute 'xla_device'"; without torch_xla it stops naming fairseq-hydra-train common.bf16=true."""
    last = last_line_of_training_with("--bf16", text_data_bin, tmp_path)
    assert "--bf16 (which fairseq-train turns into --tpu)" in last, last
    assert "fairseq-hydra-train with common.fp16=false common.bf16=true" in last
    # --memory-efficient-bf16, which fairseq-train turns into --bf16, is named as typed
    from lion_fairseq.clear_errors import tpu_message

    typed = tpu_message(argparse.Namespace(tpu=True, bf16=True, memory_efficient_bf16=True))
    assert typed.startswith("--memory-efficient-bf16 (which fairseq-train turns into --tpu)"), typed


def test_fp16_without_a_gpu_names_what_runs(text_data_bin, tmp_path, monkeypatch):
    """fairseq-train --fp16 on a machine without CUDA (LION's hydra configs set common.fp16: true) stopped in
    fairseq's FP16Optimizer with a traceback ending "Torch not compiled with CUDA enabled"; it stops naming
    float32 and bf16. --memory-efficient-fp16 ran until the loss scaler's first overflow, and stopped so then;
    --amp runs on CPUs, and a GPU runs all. bf16 over fp16 (common.bf16=true over LION's configs) trained in
    fp16 without loss scaling until the first overflow, on any device: it stops naming common.fp16=false."""
    from lion_fairseq.clear_errors import fp16_and_bf16_message, fp16_without_cuda_message

    last = last_line_of_training_with("--fp16", text_data_bin, tmp_path)
    assert "--fp16 trains with fairseq's fp16 optimizers, whose loss scaling needs a CUDA GPU" in last, last
    assert "fairseq-hydra-train common.fp16=false common.bf16=true common.cpu=true" in last  # the configs set fp16
    assert fp16_without_cuda_message(argparse.Namespace(fp16=True, memory_efficient_fp16=True)).startswith(
        "--memory-efficient-fp16 trains with fairseq's fp16 optimizers, whose loss scaling needs a CUDA GPU")
    assert "pass common.fp16=false common.bf16=true" in fp16_and_bf16_message(argparse.Namespace(fp16=True, bf16=True))
    assert fp16_and_bf16_message(argparse.Namespace(fp16=False, bf16=True)) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fp16_without_cuda_message(argparse.Namespace(fp16=True, memory_efficient_fp16=False)) is None


def test_tpu_runs_are_left_to_fairseq_where_torch_xla_is(monkeypatch):
    """On a TPU host (torch_xla installed) --tpu and fairseq-train's --bf16 run fairseq's TPU code: the
    plugin refuses them only without torch_xla."""
    import importlib.util

    from lion_fairseq.clear_errors import tpu_message

    run = argparse.Namespace(tpu=True, bf16=True, memory_efficient_bf16=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch_xla" else real(name, *a))
    assert tpu_message(run) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_xla" else real(name, *a))
    assert tpu_message(run).startswith("--bf16 (which fairseq-train turns into --tpu)")


# ---- precision ------------------------------------------------------------------------------------------

LONG = 4096
SCALE = 4096  # a loss scale that fairseq's --fp16 scaler reaches, at which fp16's gradients here do not underflow


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("task, arch", [("language_modeling", "lion_s_lm_tiny"), ("masked_lm", "lion_d_tiny")])
def test_half_precision_training_step_at_4096_stays_finite(text_data_bin, task, arch, dtype):
    """A model cast to bf16/fp16 (what fairseq's --fp16 / common.bf16 do) takes a forward and backward at
    L = 4096 in the chunk form: finite loss and gradients, close to the float32 loss (the states and
    the normaliser accumulate in float32), and the attention's gradients close to float32's (an untrained
    model's loss hardly depends on its attention)."""
    torch.manual_seed(0)
    t, model = build(text_data_bin, task, "--arch", arch, "--tokens-per-sample", str(LONG), "--lion-form", "chunk",
                     "--lion-chunk-size", "64", "--dropout", "0")
    V = len(t.source_dictionary)
    tokens = torch.randint(4, V, (1, LONG))
    losses, attention_grads = {}, {}
    for dt in (torch.float32, dtype):
        m = model.to(dt)
        m.zero_grad()
        logits = m(tokens)[0]
        assert logits.dtype == dt
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, V), tokens.view(-1))
        (loss * SCALE).backward()
        grads = {name: p.grad.float() / SCALE for name, p in m.named_parameters() if p.grad is not None}
        assert len(grads) > 10 and all(torch.isfinite(g).all() for g in grads.values()), dt
        losses[dt] = float(loss)
        attention_grads[dt] = {name: g for name, g in grads.items() if ".self_attn.q_proj.weight" in name}
    assert abs(losses[dtype] - losses[torch.float32]) < 0.02 * losses[torch.float32], losses
    for name, exact in attention_grads[torch.float32].items():
        error = (attention_grads[dtype][name] - exact).norm() / exact.norm()
        assert error < 0.05, (name, float(error))  # measured: 1e-2 in bf16, 2e-3 in fp16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_operator_forms_agree_in_half_precision(dtype):
    """Every form, bidirectional and causal, in bf16/fp16 at L = 700 with per-token gates from near 0
    to near 1 (and a padded tail): within 1e-2 relative RMS of the float64 definition, in the input dtype."""
    from lion_fairseq.ops import lion_attention
    from reference import fast_reference_attention

    g = torch.Generator().manual_seed(0)
    L = 700  # several chunks of 64 and a remainder
    q, k = torch.rand(1, 2, L, 16, generator=g) + 0.05, torch.rand(1, 2, L, 16, generator=g) + 0.05
    v = torch.randn(1, 2, L, 16, generator=g)
    logits = torch.randn(1, 2, L, generator=g) * 4 + 2  # gates sigmoid(x) from ~1e-3 to ~1 - 1e-6
    f, b = torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(logits.flip(-1))
    pad = torch.zeros(1, L, dtype=torch.bool)
    pad[:, -50:] = True
    rms = lambda x: x.double().pow(2).mean().sqrt()  # noqa: E731
    for causal in (False, True):
        ref = fast_reference_attention(q, k, v, f, b, causal=causal, key_padding_mask=pad)[..., :-50, :]
        for form in ("parallel", "chunk", "recurrent"):
            with torch.no_grad():
                y = lion_attention(q.to(dtype), k.to(dtype), v.to(dtype), f, b, form=form, causal=causal,
                                   key_padding_mask=pad, chunk_size=64)
            assert y.dtype == dtype and torch.isfinite(y).all(), (form, causal)
            err = float(rms(y[..., :-50, :].double() - ref) / rms(ref))
            assert err < 1e-2, (form, causal, err)


def test_bf16_training_with_fairseq_hydra_train(text_data_bin, tmp_path):
    """The bf16 route on CPU (fairseq-train --bf16 takes a TPU code path, --fp16 needs CUDA):
    ``fairseq-hydra-train common.bf16=true`` with the plugin as ``common.user_dir``. Tiny LION-S LM at
    L = 4096: finite losses, fairseq's mixed-precision optimizer. (The sizes are spelled out: see
    test_hydra_model_name_of_an_arch_keeps_the_dataclass_defaults.)"""
    config = tmp_path / "lm_bf16.yaml"
    config.write_text(f"""# @package _group_
common: {{user_dir: {USER_DIR}, bf16: true, cpu: true, seed: 3, log_format: json, log_interval: 1}}
task: {{_name: language_modeling, data: {text_data_bin}, tokens_per_sample: {LONG}}}
model: {{_name: lion_s_lm_tiny, lion_variant: s, decoder_layers: 2, decoder_embed_dim: 128,
         decoder_ffn_embed_dim: 512, decoder_attention_heads: 2, lion_chunk_size: 64}}
criterion: {{_name: cross_entropy}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: fixed}}
optimization: {{lr: [0.003], max_update: 2}}
dataset: {{batch_size: 1, num_workers: 0, disable_validation: true}}
checkpoint: {{save_dir: {tmp_path / 'ckpt'}, no_epoch_checkpoints: true}}
""")
    log = tmp_path / "hydra.log"
    out = finish({"hydra": start(None, ["--config-dir", str(tmp_path), "--config-name", "lm_bf16",
                                        f"hydra.run.dir={tmp_path / 'hydra'}"], log, module="hydra_train")},
                 {"hydra": log})["hydra"]
    losses = train_losses(out)
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), out[-2000:]
    state = torch.load(tmp_path / "ckpt" / "checkpoint_last.pt", weights_only=True)
    assert state["cfg"]["common"]["bf16"] is True
    weights = state["model"]
    assert weights["decoder.embed_tokens.weight"].shape[1] == 128
    assert weights["decoder.layers.0.self_attn.gate_proj.weight"].shape == (2, 128)
    # trained as a bf16 model with float32 master weights (fairseq's FP16Optimizer, which also serves bf16);
    # fairseq saves the weights in float32 (utils.move_to_cpu casts half types)
    assert state["optimizer_history"][-1]["optimizer_name"] == "FP16Optimizer"
    # resumed as another model: refused, naming the change and how fairseq-hydra-train spells the options
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.hydra_train", "--config-dir", str(tmp_path),
                           "--config-name", "lm_bf16", f"hydra.run.dir={tmp_path / 'hydra'}",
                           "optimization.max_update=3", "+model.lion_feature_map=elu"],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "cannot resume" in proc.stderr, proc.stderr[-3000:]
    assert "--lion-feature-map silu_norm -> --lion-feature-map elu" in proc.stderr
    assert "(--reset-optimizer: checkpoint.reset_optimizer=true)" in proc.stderr


def test_a_run_moves_between_fairseq_hydra_train_and_fairseq_train(text_data_bin, tmp_path):
    """A hydra config naming the model (``_name: lion_lm``) and leaving the variant and the heads to it saves
    None for them, where ``fairseq-train --arch lion_lm`` saves s and 8: the same model, which resumes under
    the other launcher (it was refused as 'trained as another model'). And a relative restore file that hydra
    would read from its run folder, passing over the user's file, is refused naming the file."""
    config = tmp_path / "lm.yaml"
    config.write_text(f"""# @package _group_
common: {{user_dir: {USER_DIR}, cpu: true, seed: 3, log_format: json, log_interval: 1}}
task: {{_name: language_modeling, data: {text_data_bin}, tokens_per_sample: 32}}
model: {{_name: lion_lm, decoder_layers: 2, decoder_embed_dim: 64, decoder_ffn_embed_dim: 128}}
criterion: {{_name: cross_entropy}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: fixed}}
optimization: {{lr: [0.003], max_update: 2}}
dataset: {{batch_size: 4, num_workers: 0, disable_validation: true}}
checkpoint: {{save_dir: {tmp_path / 'run'}, no_epoch_checkpoints: true}}
""")
    hydra = [sys.executable, "-m", "fairseq_cli.hydra_train", "--config-dir", str(tmp_path), "--config-name", "lm"]
    proc = subprocess.run([*hydra, f"hydra.run.dir={tmp_path / 'hydra'}"], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fairseq_cli("train", str(text_data_bin), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                "lion_lm", "--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128",
                "--tokens-per-sample", "32", "--batch-size", "4", "--optimizer", "adam", "--lr", "0.003",
                "--max-update", "3", "--disable-validation", "--no-epoch-checkpoints", "--cpu", "--seed", "3",
                "--save-dir", str(tmp_path / "run"))
    assert torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True)["optimizer_history"][-1][
        "num_updates"] == 3
    # and back: the hydra config resumes fairseq-train's checkpoint
    proc = subprocess.run([*hydra, f"hydra.run.dir={tmp_path / 'hydra'}", "optimization.max_update=4"], env=ENV,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True)["optimizer_history"][-1][
        "num_updates"] == 4
    # from tmp_path, run/checkpoint_last.pt names that file; hydra reads it from hydra.run.dir, where it is not
    proc = subprocess.run([*hydra, f"hydra.run.dir={tmp_path / 'hydra2'}", f"checkpoint.save_dir={tmp_path / 'new'}",
                           "checkpoint.restore_file=run/checkpoint_last.pt", "optimization.max_update=4"],
                          env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and f"pass its absolute path, {tmp_path / 'run' / 'checkpoint_last.pt'}" in \
        proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "new").exists() or not list((tmp_path / "new").glob("*.pt"))


def test_hydra_model_name_of_an_arch_keeps_the_dataclass_defaults(text_data_bin):
    from fairseq import tasks
    from fairseq_cli.hydra_train import add_defaults
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"task": {"_name": "language_modeling", "data": str(text_data_bin)},
                            "model": {"_name": "lion_lit_lm_tiny"}})
    add_defaults(cfg)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    assert model.decoder.layers[0].self_attn.variant == "lit" and len(model.decoder.layers) == 2
    assert model.decoder.layers[0].self_attn.embed_dim == 128
    # the model's own name gets the base size and LION-S; the same holds for the encoder
    cfg = OmegaConf.create({"task": {"_name": "language_modeling", "data": str(text_data_bin)},
                            "model": {"_name": "lion_lm"}})
    add_defaults(cfg)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    assert model.decoder.layers[0].self_attn.variant == "s" and len(model.decoder.layers) == 6
    for name, variant, layers in (("lion_lit_tiny", "lit", 2), ("lion_roberta", "s", 12)):
        cfg = OmegaConf.create({"task": {"_name": "masked_lm", "data": str(text_data_bin)}, "model": {"_name": name}})
        add_defaults(cfg)
        model = tasks.setup_task(cfg.task).build_model(cfg.model)
        layer = model.encoder.sentence_encoder.layers[0]
        assert len(model.encoder.sentence_encoder.layers) == layers
        assert layer.self_attn.variant == variant



@pytest.mark.parametrize("name, task, arch", [("lion_lm", "language_modeling", "lion_s_lm"),
                                              ("lion_roberta", "masked_lm", "lion_s"),
                                              ("lion_transformer", "translation", "lion_s_transformer"),
                                              ("lion_lra", "lra_retrieval", "lion_s_lra_retrieval")])
def test_model_name_as_arch_on_the_command_line_is_its_lion_s_arch(text_data_bin, name, task, arch):
    # fairseq lists each model's name among the --arch choices; its arch did nothing, and fairseq-train
    # stopped in hydra's "field 'model.lion_normalize' is not Optional"
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    def model_cfg(a: str) -> dict:
        args = training_args(text_data_bin, task, "--arch", a)
        cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args).model)
        cfg.pop("_name")
        return cfg

    cfg = model_cfg(name)
    assert cfg == model_cfg(arch) and cfg["lion_variant"] == "s" and cfg["lion_normalize"] is True


# ---- checkpoints ----------------------------------------------------------------------------------------

def test_checkpoints_load_under_weights_only_without_turning_it_off(runs):
    from fairseq import checkpoint_utils

    for t in TASKS:
        ckpt = runs[t]["dir"]["straight"] / "checkpoint_last.pt"
        assert torch.load(ckpt, weights_only=True)["cfg"]["model"]["_name"] == TASKS[t][3]
        state = checkpoint_utils.load_checkpoint_to_cpu(str(ckpt))
        assert state["cfg"].model._name == TASKS[t][3]
    # a legacy checkpoint (argparse.Namespace args) reads through fairseq with Namespace allowed for that
    # call only; torch's default still refuses it afterwards, and arbitrary classes stay refused
    assert argparse.Namespace not in torch.serialization.get_safe_globals()
    path = runs["lm"]["dir"]["straight"] / "legacy.pt"
    torch.save({"args": argparse.Namespace(arch="lion_s_lm_tiny"), "model": {}}, path)
    assert clear_errors.load_checkpoint_file(str(path))["args"].arch == "lion_s_lm_tiny"
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path)
    assert argparse.Namespace not in torch.serialization.get_safe_globals()


def test_checkpoints_load_on_torch_without_safe_globals(runs, monkeypatch):
    """torch 2.1-2.4, simulated: no ``torch.serialization.safe_globals`` (2.5) and ``torch.load`` not
    ``weights_only`` by default (2.6). The plugin's wrapper of fairseq's checkpoint reader must not need
    the newer API: LION and legacy (argparse.Namespace) checkpoints load, and check_checkpoint explains."""
    import functools

    from fairseq import checkpoint_utils

    monkeypatch.delattr(torch.serialization, "safe_globals")
    monkeypatch.setattr(torch, "load", functools.partial(torch.load, weights_only=False))
    ckpt = runs["lm"]["dir"]["straight"] / "checkpoint_last.pt"
    assert checkpoint_utils.load_checkpoint_to_cpu(str(ckpt))["cfg"].model._name == TASKS["lm"][3]
    legacy = runs["lm"]["dir"]["straight"] / "legacy_old_torch.pt"
    torch.save({"args": argparse.Namespace(arch="lion_s_lm_tiny"), "model": {}}, legacy)
    assert clear_errors.load_checkpoint_file(str(legacy))["args"].arch == "lion_s_lm_tiny"
    assert "model/arch 'lion_s_lm_tiny'" in check_checkpoint.explain(str(ckpt))


def test_truncated_checkpoint_says_so_and_what_to_pass(runs, tmp_path):
    from fairseq import checkpoint_utils

    good = runs["lm"]["dir"]["straight"]
    broken = tmp_path / "checkpoint_last.pt"
    intact = tmp_path / f"checkpoint_1_{HALF}.pt"
    data = (good / "checkpoint_last.pt").read_bytes()
    intact.write_bytes(data)
    cut = tmp_path / "checkpoint_best.pt"
    cut.write_bytes(data[:len(data) // 3])
    # killed while copying; killed before the first byte; cut within 64 KiB (torch's zip reader: OSError EINVAL)
    for size in (len(data) // 2, 0, 20000):
        broken.write_bytes(data[:size])
        with pytest.raises(clear_errors.CheckpointError) as err:
            checkpoint_utils.load_checkpoint_to_cpu(str(broken))
        msg = str(err.value)
        assert "truncated or corrupt" in msg and f"({size} bytes)" in msg and "--restore-file" in msg
        assert str(intact) in msg and str(cut) not in msg  # the complete checkpoint is named, not the cut one
        # deleting checkpoint_last.pt restarts the run from scratch over the intact ones: not the advice
        assert "copy an intact checkpoint_<epoch>_<update>.pt over it" in msg and "delete or" not in msg
        # so do the plugin's own readers (python -m lion_fairseq.convert, --teacher, check_checkpoint)
        with pytest.raises(clear_errors.CheckpointError, match="truncated or corrupt"):
            clear_errors.load_checkpoint_file(str(broken))
    # the explainer command says the same, and what an intact plugin checkpoint needs
    text = check_checkpoint.explain(str(broken))
    assert text.startswith("cannot read checkpoint")
    # bytes changed in the middle: torch.load reads the file; the explainer finds the record that fails its CRC
    with zipfile.ZipFile(intact) as z:  # inside the largest tensor's bytes, past its record's local header
        record = max(z.infolist(), key=lambda i: i.file_size)
    names = int.from_bytes(data[record.header_offset + 26:record.header_offset + 28], "little")
    extra = int.from_bytes(data[record.header_offset + 28:record.header_offset + 30], "little")
    middle = record.header_offset + 30 + names + extra + record.file_size // 2
    damaged = bytearray(data)
    damaged[middle:middle + 64] = bytes(64)
    (tmp_path / "damaged.pt").write_bytes(bytes(damaged))
    text = check_checkpoint.explain(str(tmp_path / "damaged.pt"))
    assert text.startswith("cannot read checkpoint") and "fails its CRC check" in text, text
    # and fairseq's reader, where fairseq-train resumed from it (and saved over it) and the tools evaluated it
    for read in (checkpoint_utils.load_checkpoint_to_cpu, clear_errors.load_checkpoint_file):
        with pytest.raises(clear_errors.CheckpointError, match=r"truncated or corrupt \(ValueError: its record "
                                                               rf"{re.escape(record.filename)} fails its CRC check"):
            read(str(tmp_path / "damaged.pt"))
    # a file that is no checkpoint at all is not called intact (torch's weights_only refusal of its bytes)
    (tmp_path / "notes.pt").write_text("not a checkpoint\n" * 100)
    text = check_checkpoint.explain(str(tmp_path / "notes.pt"))
    assert "it is not a checkpoint" in text and "intact, but" not in text, text
    text = check_checkpoint.explain(str(intact))
    assert "'lion_s_lm_tiny'" in text and f"--user-dir {clear_errors.PACKAGE_DIR}" in text and "KeyError" in text
    proc = subprocess.run([sys.executable, "-m", "lion_fairseq.check_checkpoint", str(intact), str(broken)], env=ENV,
                          cwd=str(Path(USER_DIR).parent), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "--user-dir" in proc.stdout and "truncated or corrupt" in proc.stdout, proc
    # the complete checkpoints are named newest first: the one to resume from leads
    newer = tmp_path / f"checkpoint_2_{UPDATES}.pt"
    newer.write_bytes(data)
    os.utime(intact, (1e9, 1e9))
    msg = str(clear_errors.checkpoint_file_error(str(broken), EOFError()))
    assert str(newer) in msg and msg.index(str(newer)) < msg.index(str(intact)), msg
    # one whose bytes fail their CRCs is not offered, however new (it was, first)
    os.utime(tmp_path / "damaged.pt", None)
    msg = str(clear_errors.checkpoint_file_error(str(broken), EOFError()))
    assert str(newer) in msg and "damaged.pt" not in msg, msg
    # a folder is not "no such file": the newest intact checkpoint in it is named
    text = check_checkpoint.explain(str(tmp_path))
    assert text == f"{tmp_path}: a folder; pass a checkpoint file, e.g. its newest intact one, {newer}", text
    assert check_checkpoint.main([str(tmp_path)]) == 1


def test_load_errors_that_are_not_the_files_come_through_or_are_explained():
    """fairseq's checkpoint reader failing for another reason than the file's bytes (a size mismatch, say)
    is not called a corrupt file; and where fairseq's trainer hides a ValueError of the plugin's (a teacher's
    weights that fit no model of this kind) behind 'ensure that the architectures match', that ValueError
    is what the user reads last."""
    from types import SimpleNamespace

    def reader(path, arg_overrides=None, load_on_all_ranks=False):
        raise RuntimeError("size mismatch for decoder.embed_tokens.weight")

    with pytest.raises(RuntimeError, match="^size mismatch for decoder.embed_tokens.weight$"):
        clear_errors._wrap_load_checkpoint_to_cpu(reader)(__file__)

    def load_checkpoint(self, filename, *args, **kwargs):
        try:
            raise ValueError("the teacher's attention is 64 wide and this model's 128")
        except ValueError as e:
            raise Exception(f"Cannot load model parameters from checkpoint {filename}; please ensure that the "
                            "architectures match.") from e

    trainer = SimpleNamespace(cfg=SimpleNamespace(checkpoint=SimpleNamespace(restore_file="checkpoint_last.pt"),
                                                  model=SimpleNamespace(_name="lion_s_tiny")))
    with pytest.raises(clear_errors.CheckpointError, match="cannot start from teacher.pt: the teacher's attention "
                                                           "is 64 wide and this model's 128"):
        clear_errors._wrap_trainer_load_checkpoint(load_checkpoint)(trainer, "teacher.pt")


def test_numpy_scores_load_and_a_refused_object_is_not_called_corrupt(runs, tmp_path):
    """fairseq keeps the best score as a numpy scalar where sklearn or scipy computed it (GLUE's MRPC, QQP,
    STS-B: --report-acc-and-f1, --report-pearson-and-spearman), and --eval-bleu's counts as numpy arrays in
    its meters, which torch's weights_only load refused: such checkpoints load. An intact file holding an
    object that is still refused is said to be intact, naming the object, not truncated or corrupt."""
    import fractions

    import numpy as np
    from fairseq import checkpoint_utils

    state = torch.load(runs["lm"]["dir"]["straight"] / "checkpoint_last.pt", weights_only=True)
    state["extra_state"]["best"] = np.float64(0.8125)
    state["extra_state"]["_bleu_counts"] = np.array([31, 17, 9, 4])  # --eval-bleu's, among the saved meters
    scored = tmp_path / "checkpoint_best.pt"
    torch.save(state, scored)
    extra = checkpoint_utils.load_checkpoint_to_cpu(str(scored))["extra_state"]
    assert extra["best"] == 0.8125 and isinstance(extra["best"], np.float64)
    assert np.array_equal(extra["_bleu_counts"], [31, 17, 9, 4])
    assert "'lion_s_lm_tiny'" in check_checkpoint.explain(str(scored))
    state["extra_state"]["odd"] = fractions.Fraction(1, 3)
    odd = tmp_path / "checkpoint_odd.pt"
    torch.save(state, odd)
    with pytest.raises(clear_errors.CheckpointError, match=r"the file is intact, but it holds fractions\.Fraction"):
        checkpoint_utils.load_checkpoint_to_cpu(str(odd))
    text = check_checkpoint.explain(str(odd))
    assert "intact" in text and "truncated" not in text


def test_checkpoint_of_another_architecture_names_both(runs, text_data_bin):
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(str(runs["mlm"]["dir"]["straight"] / "checkpoint_last.pt"))
    _, model = build(text_data_bin, "masked_lm", "--arch", "lion_s_tiny")  # checkpoint is lion_d_tiny
    with pytest.raises(RuntimeError) as err:
        model.load_state_dict(state["model"], strict=True, model_cfg=state["cfg"].model)
    msg = str(err.value)
    assert "lion_d (one gate per head), 2 layers, width 128" in msg and "lion_s (a gate per token)" in msg
    assert "--arch" in msg and "gate_proj" in msg  # what to pass, and torch's own detail
    # an LM checkpoint into an MLM model: not even the same stack
    lm = checkpoint_utils.load_checkpoint_to_cpu(str(runs["lm"]["dir"]["straight"] / "checkpoint_last.pt"))
    with pytest.raises(RuntimeError, match="this checkpoint's weights do not fit"):
        model.load_state_dict(lm["model"], strict=True)


# ---- bad input ------------------------------------------------------------------------------------------

def test_empty_split_is_named(text_data_bin, tmp_path):
    from fairseq.data import indexed_dataset

    data = tmp_path / "bin"
    data.mkdir()
    (data / "dict.txt").write_text((text_data_bin / "dict.txt").read_text())
    builder = indexed_dataset.make_builder(str(data / "train.bin"), impl="mmap", vocab_size=2000)
    builder.finalize(str(data / "train.idx"))  # what fairseq-preprocess writes for an empty text file
    assert (data / "train.bin").stat().st_size == 0
    for task, arch in (("language_modeling", "lion_s_lm_tiny"), ("masked_lm", "lion_s_tiny")):
        t, _ = build(data, task, "--arch", arch, "--tokens-per-sample", "32")
        # and the fix for each command: eval-lm and generate read --gen-subset, not the training options
        with pytest.raises(ValueError, match=r"data split 'train' is empty: .*train\.bin has no tokens.*"
                                             r"fairseq-eval-lm and fairseq-generate --gen-subset") as err:
            t.load_dataset("train")
        # refused before fairseq's reader half-opened the file (its destructor then failed, printed last)
        assert err.value.__context__ is None


def test_dictionary_that_does_not_match_the_binaries(text_data_bin, tmp_path):
    """Binaries made with a 2000-word dictionary, read with a 100-word dict.txt: the first batch stops
    with a message naming the dictionary, not torch's 'index out of range in self'."""
    data = tmp_path / "bin"
    data.mkdir()
    for f in text_data_bin.glob("train.*"):
        (data / f.name).write_bytes(f.read_bytes())
    (data / "dict.txt").write_text("".join((text_data_bin / "dict.txt").read_text().splitlines(True)[:96]))
    for task, arch in (("language_modeling", "lion_s_lm_tiny"), ("masked_lm", "lion_d_tiny")):
        t, model = build(data, task, "--arch", arch, "--tokens-per-sample", "32")
        t.load_dataset("train")
        sample = t.dataset("train").collater([t.dataset("train")[i] for i in range(4)])
        with pytest.raises(ValueError, match=r"token id \d+ is past the dictionary's 10[01] entries.*--srcdict"):
            model(**sample["net_input"])


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_longer_than_training_length(text_data_bin, variant):
    """LION-LIT's learned positions stop at --tokens-per-sample, with a message; LION-D and LION-S have no
    positions and encode 4x the training length, every form agreeing."""
    torch.manual_seed(0)
    for task, arch in (("masked_lm", f"lion_{variant}_tiny"), ("language_modeling", f"lion_{variant}_lm_tiny")):
        t, model = build(text_data_bin, task, "--arch", arch, "--tokens-per-sample", "32", "--dropout", "0")
        model.eval()
        tokens = torch.randint(4, len(t.source_dictionary), (2, 128))
        if variant == "lit":
            with pytest.raises(ValueError, match="exceeds the 32 learned positions.*--lion-positions none"):
                model(tokens)
            model(tokens[:, :32])  # the training length itself is fine
            continue
        outs = {}
        for form in ("parallel", "chunk", "recurrent"):
            for m in model.modules():
                if hasattr(m, "form") and hasattr(m, "chunk_size"):
                    m.form = form
            with torch.no_grad():
                outs[form] = model(tokens)[0]
            assert torch.isfinite(outs[form]).all()
        for form in ("chunk", "recurrent"):
            torch.testing.assert_close(outs[form], outs["parallel"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad, message", [
    (["--lion-positions", "sinusoidal"], r"--lion-positions: invalid choice: 'sinusoidal'"),
    (["--lion-variant", "x"], r"--lion-variant: invalid choice: 'x'"),
    (["--lion-feature-map", "relu2"], r"--lion-feature-map: invalid choice: 'relu2'"),
    (["--lion-chunk-size", "sixty"], r"--lion-chunk-size: invalid int value: 'sixty'"),
    (["--lion-chunk-size", "-3"], r"--lion-chunk-size must be an integer >= 1; got -3"),
])
def test_unknown_lion_values_name_the_option(text_data_bin, capsys, bad, message):
    with pytest.raises((SystemExit, ValueError)) as err:
        build(text_data_bin, "language_modeling", "--arch", "lion_s_lm_tiny", *bad)
    text = str(err.value) + capsys.readouterr().err
    assert re.search(message, text), text


ENCODERS = "lion_{lit,d,s}[_large|_tiny], lion_retnet"


def expand_archs(pattern: str) -> set:
    """The names a message's arch pattern stands for: ``lion_{lit,d}[_tiny|_large], lion_x`` -> lion_lit,
    lion_lit_tiny, ..., lion_x."""
    names = set()
    for part in pattern.split(", "):
        alternatives = re.sub(r"\[([^]]*)\]", lambda m: "{," + m.group(1).replace("|", ",") + "}", part)
        found = [""]
        for piece in re.split(r"(\{[^}]*\})", alternatives):
            options = piece[1:-1].split(",") if piece.startswith("{") else [piece]
            found = [f + o for f in found for o in options]
        names.update(found)
    return names


def test_the_archs_messages_name_are_the_registered_ones():
    """Each LION model's arch pattern, which the errors quote, names every arch registered for it and no
    other (the lists were written by hand and missed lion_retnet and lion_s_lm_plus)."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    for model, (_, _, pattern) in clear_errors.LION_MODELS.items():
        registered = {arch for arch, m in ARCH_MODEL_NAME_REGISTRY.items() if m == model and arch != model}
        assert expand_archs(pattern) == registered, (model, expand_archs(pattern) ^ registered)


@pytest.mark.parametrize("task, arch, takes", [
    ("masked_lm", "lion_s_lm_tiny", ENCODERS),
    ("sentence_prediction", "lion_d_lm", ENCODERS),
    ("language_modeling", "lion_s_tiny", "lion_{lit,d,s}_lm[_tiny], lion_retnet_lm, lion_s_lm_plus[_tiny]"),
    ("masked_lm", "lion_s_transformer_tiny", ENCODERS),
    ("translation", "lion_lm", "lion_{lit,d,s}_transformer[_tiny|_iwslt_de_en]"),
    ("lra_listops", "lion_s_tiny", "lion_{lit,d,s}_lra_{listops,text,retrieval,image,pathfinder,pathx,small,tiny}"),
    # the image tasks of LRA too: fairseq stopped in omegaconf there ('task.tokens_per_sample' not found)
    ("lra_pathfinder", "lion_s_lm_tiny", "lion_{lit,d,s}_lra_{listops,text,retrieval,image,pathfinder,pathx,small,tiny}"),
    ("lra_pathx", "lion_s_transformer_tiny", "lion_{lit,d,s}_lra_{listops,text,retrieval,image,pathfinder,pathx,small,"
                                             "tiny}"),
])
def test_a_lion_arch_with_another_models_task_names_the_archs_the_task_takes(text_data_bin, task, arch, takes):
    """fairseq stopped in omegaconf ("Interpolation key 'task.max_target_positions' not found") or in an
    AttributeError of the task; the arch now says what it is and which archs the task takes."""
    with pytest.raises(ValueError, match=rf"--arch {arch} is .* which trains with --task .*; --task {task} takes .*"
                                         rf"pass an arch of {re.escape(takes)} with it"):
        training_args(text_data_bin, task, "--arch", arch)


@pytest.mark.parametrize("task, arch", [("masked_lm", "lion_s_tiny"), ("masked_lm", "lion_lit_tiny"),
                                        ("language_modeling", "lion_lit_lm_tiny")])
def test_models_build_from_fairseqs_parsed_namespace(text_data_bin, task, arch):
    """fairseq's older Python API, ``task.build_model(args)`` with the Namespace of ``parse_args_and_arch``, builds
    LION models as it builds roberta_base (the encoder read an unset --max-positions as an attribute)."""
    from fairseq import tasks

    from lion_fairseq.models.lion_options import UNBOUNDED_POSITIONS

    args = training_args(text_data_bin, task, "--arch", arch, "--tokens-per-sample", "64")
    model = tasks.setup_task(args).build_model(args)
    assert model.max_positions() == (64 if "lit" in arch else UNBOUNDED_POSITIONS)  # the task's length


def test_a_task_lion_does_not_know_is_left_to_the_user(text_data_bin):
    """A task outside the plugin's list (a user's own, or fairseq's sentence_ranking) is not refused."""
    args = training_args(text_data_bin, "sentence_ranking", "--arch", "lion_s_tiny", "--num-classes", "2")
    assert args.arch == "lion_s_tiny" and args.lion_variant == "s"


CHECKPOINT_TOOLS = ["get_eval_lm_parser", "get_validation_parser", "get_generation_parser",
                    "get_interactive_generation_parser"]


def checkpoint_tool_error(text_data_bin, capsys, parser: str, *flags: str) -> str:
    """What a tool that reads its model from a checkpoint (fairseq-eval-lm, -validate, -generate,
    -interactive) says to ``flags`` while it parses its command line."""
    from fairseq import options

    with pytest.raises(SystemExit) as e:
        options.parse_args_and_arch(getattr(options, parser)(), [
            str(text_data_bin), "--user-dir", USER_DIR, "--path", "checkpoint.pt", "--task", "language_modeling",
            *flags])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("parser", CHECKPOINT_TOOLS)
def test_lion_flags_on_tools_that_read_the_checkpoint_say_what_to_pass(text_data_bin, capsys, parser):
    """argparse said only "unrecognized arguments: --lion-form recurrent"; the message now gives the override
    that switches the form (a Python literal fairseq reads as it is), or says the option is set by training."""
    import ast

    for flags, key, value in ((["--lion-form", "recurrent"], "lion_form", "recurrent"),
                              (["--lion-chunk-size=128"], "lion_chunk_size", 128)):
        err = checkpoint_tool_error(text_data_bin, capsys, parser, *flags)
        override = re.search(r'--model-overrides "(.*)"', err)
        assert f"error: {flags[0].split('=')[0]}: this command takes the model's options from its checkpoint" in err
        assert override and ast.literal_eval(override.group(1)) == {key: value}, err
    for flag in ("--no-lion-normalize", "--lion-feature-map", "--lion-cross-attention"):
        err = checkpoint_tool_error(text_data_bin, capsys, parser, flag, "identity")
        assert f"error: {flag}: this command runs the checkpoint's model as it was trained" in err, err
    # unset, they add nothing to what the tool parses
    from fairseq import options

    args = options.parse_args_and_arch(getattr(options, parser)(), [
        str(text_data_bin), "--user-dir", USER_DIR, "--path", "checkpoint.pt", "--task", "language_modeling"])
    assert not [k for k in vars(args) if k.startswith("lion_")]


def test_lion_flags_on_fairseq_train_without_a_model_that_takes_them(text_data_bin, capsys, monkeypatch):
    """fairseq's own model, or a LION model of another kind, named with what takes the flag."""
    with pytest.raises(SystemExit):
        training_args(text_data_bin, "masked_lm", "--arch", "roberta", "--lion-form", "chunk")
    assert "error: --lion-form is an option of every LION arch, not of --arch roberta: leave it out" in \
        capsys.readouterr().err
    # before --arch, which argparse has not read yet (it was told to use --model-overrides, an evaluation option),
    # or between two, of which argparse keeps the last (a recipe's --arch, then the user's)
    monkeypatch.setattr(sys, "argv", ["fairseq-train", "--arch", "lion_s_tiny"])  # not the list parsed
    for arch in (["--arch", "roberta"], ["-a", "roberta"], ["--arch=roberta"]):
        for command in (["--lion-form", "chunk", *arch], ["--arch", "lion_s_tiny", "--lion-form", "chunk", *arch]):
            with pytest.raises(SystemExit):
                training_args(text_data_bin, "masked_lm", *command)
            assert "error: --lion-form is an option of every LION arch, not of --arch roberta: leave it out" in \
                capsys.readouterr().err, command
    with pytest.raises(SystemExit):
        training_args(text_data_bin, "language_modeling", "--arch", "lion_s_lm_tiny", "--lion-cross-attention",
                      "linear")
    assert ("error: --lion-cross-attention is an option of the archs lion_{lit,d,s}_transformer[_tiny|_iwslt_de_en] "
            "(a translation model), not of --arch lion_s_lm_tiny: leave it out") in capsys.readouterr().err


def test_num_classes_below_the_labels_is_refused_and_above_them_logged(labelled_data_bin, caplog):
    """fairseq trained until the first batch with label 1 and stopped: "IndexError: Target 1 is out of bounds"."""
    args = ("--criterion", "sentence_prediction", "--arch", "lion_s_tiny", "--max-positions", "64")
    with pytest.raises(ValueError, match=r"--num-classes 1, and .*label/dict.txt holds 2 labels \((0, 1|1, 0)\): "
                                         r"pass --num-classes 2"):
        build(labelled_data_bin, "sentence_prediction", *args, "--num-classes", "1")
    _, model = build(labelled_data_bin, "sentence_prediction", *args, "--num-classes", "3")
    assert model.classification_heads["sentence_classification_head"].out_proj.out_features == 3
    assert "--num-classes 3, and" in caplog.text and "1 classes that no example has" in caplog.text
    caplog.clear()
    build(labelled_data_bin, "sentence_prediction", *args, "--num-classes", "2")
    assert "no example has" not in caplog.text


def test_a_model_name_fairseq_does_not_know_is_named_with_the_nearest():
    """fairseq's own assertion formats the config into its message and stops with KeyError: "'_name'"."""
    from fairseq import models
    from omegaconf import OmegaConf

    with pytest.raises(ValueError, match=r"model 'lion_robert' is no model or arch fairseq knows: did you mean "
                                         r"'lion_roberta'\? \(LION's models: lion_roberta, archs "):
        models.build_model(OmegaConf.create({"_name": "lion_robert", "encoder_layers": 2}), None)


def test_model_errors_under_hydra_say_how_hydra_spells_the_options(text_data_bin, monkeypatch):
    """An option named as fairseq-train spells it (--lion-chunk-size) gets hydra's spelling beside it when
    fairseq-hydra-train runs."""
    from fairseq import models, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(training_args(text_data_bin, "masked_lm", "--arch", "lion_s_tiny"))
    task = tasks.setup_task(cfg.task)
    cfg.model.lion_chunk_size = -4
    with pytest.raises(ValueError) as plain:
        models.build_model(cfg.model, task)
    assert "--lion-chunk-size must be an integer >= 1" in str(plain.value)
    assert "fairseq-hydra-train" not in str(plain.value)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fairseq-hydra-train", "--config-dir", "x"])
    with pytest.raises(ValueError, match=r"--lion-chunk-size must be an integer >= 1.*Under fairseq-hydra-train an "
                                         r"option --some-option V named here is the key some_option=V of its group"):
        models.build_model(cfg.model, task)


def test_chunk_size_larger_than_the_sequence(text_data_bin):
    torch.manual_seed(0)
    for task, arch in (("masked_lm", "lion_s_tiny"), ("language_modeling", "lion_d_lm_tiny")):
        t, model = build(text_data_bin, task, "--arch", arch, "--lion-form", "chunk", "--lion-chunk-size", "512",
                         "--dropout", "0")
        _, ref = build(text_data_bin, task, "--arch", arch, "--lion-form", "parallel", "--dropout", "0")
        ref.load_state_dict(model.state_dict())
        tokens = torch.randint(4, len(t.source_dictionary), (3, 21))
        tokens[1, 15:] = t.source_dictionary.pad()
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(tokens)[0], ref.eval()(tokens)[0], atol=1e-5, rtol=1e-5)


def test_nan_in_a_gate_input_is_reported_at_inference(text_data_bin):
    """At inference a NaN that reaches a decay gate would spread through the state to every later
    position: it is raised as FloatingPointError naming the gate, in every form. (Training lets it reach
    the loss: test_mixed_precision.py.)"""
    from lion_fairseq.modules import LionAttention

    x = torch.randn(10, 2, 16)
    x[4, 1, 3] = float("nan")
    for form in ("parallel", "chunk", "recurrent"):
        attn = LionAttention(16, 2, "s", form=form, chunk_size=4).eval()
        with pytest.raises(FloatingPointError, match=r"LION-S attention: 2 of 40 values of the gate logits .* NaN"):
            attn(x)
        attn(torch.nan_to_num(x))  # finite input passes
        assert torch.isnan(attn.train()(x)).any()  # training: no check, no host sync
    d = LionAttention(16, 2, "d").eval()
    with torch.no_grad():
        d.gate_logit[1] = float("inf")
    with pytest.raises(FloatingPointError, match=r"LION-D attention: 1 of 2 values of its learned gate logits"):
        d(torch.randn(5, 1, 16))
    # through a whole model: a NaN embedding row stops the forward with the message
    _, model = build(text_data_bin, "masked_lm", "--arch", "lion_s_tiny", "--tokens-per-sample", "32")
    with torch.no_grad():
        model.encoder.sentence_encoder.embed_tokens.weight[7] = float("nan")
    tokens = torch.full((1, 12), 9)
    tokens[0, 5] = 7
    with pytest.raises(FloatingPointError, match="gate logits"):
        model.eval()(tokens)


def test_check_checkpoint_stops_on_a_missing_file_and_reads_older_checkpoints_positions(tmp_path, capsys):
    """A missing checkpoint exits 1 (glue/finetune.sh stops on it); ``--max-positions`` reads an older
    checkpoint's argparse args too (a released RoBERTa's 512), which glue/finetune.sh passes on."""
    assert check_checkpoint.main([str(tmp_path / "nope.pt")]) == 1
    legacy = tmp_path / "legacy.pt"
    torch.save({"args": argparse.Namespace(arch="roberta_base", max_positions=512), "model": {}}, legacy)
    capsys.readouterr()
    assert check_checkpoint.main(["--max-positions", str(legacy)]) == 0
    assert capsys.readouterr().out.strip() == "512"
    # a data file given for a checkpoint is no truncated checkpoint (which it was said to be)
    data = tmp_path / "train.bin"
    data.write_bytes(bytes(range(4, 68)))
    assert check_checkpoint.main([str(data)]) == 1
    said = capsys.readouterr()
    assert f"cannot read {data} (64 bytes): it is not a checkpoint" in said.out + said.err
    # torch.save(model.state_dict()) given to fairseq's reader (the hubs', fairseq-eval-lm's): KeyError: 'best_loss'
    from fairseq import checkpoint_utils

    bare = tmp_path / "weights.pt"
    weights = torch.nn.Linear(3, 4).state_dict()
    for saved, legacy in ((weights, False), ({"model": weights}, False), (weights, True)):  # legacy: torch < 1.6's
        torch.save(saved, bare, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(clear_errors.CheckpointError, match=r"it holds 2 tensors by name and no config, a bare "):
            checkpoint_utils.load_checkpoint_to_cpu(str(bare))
    # zeros where a crash left a file's blocks unwritten: a truncated checkpoint, with what to do about it
    zeros = tmp_path / "checkpoint_last.pt"
    zeros.write_bytes(bytes(1000))
    assert "truncated or corrupt" in check_checkpoint.explain(str(zeros))
    with pytest.raises(clear_errors.CheckpointError, match="truncated or corrupt"):
        checkpoint_utils.load_checkpoint_to_cpu(str(zeros))


def test_samples_that_fairseqs_batching_drops_or_skips_are_said(text_data_bin, caplog):
    """--required-batch-size-multiple 8 (fairseq's default) drops the samples of a last batch that is no
    multiple of 8 (fairseq #5036): the validation loss of fairseq-train and fairseq-validate, and
    fairseq-generate's BLEU, left out the same samples every time, without a word. Said once per split,
    with the count and what to pass; a training split is left alone. A split whose every sample is longer
    than the run takes stops naming the limit and what to pass."""
    import logging

    for length in range(32, 40):  # blocks of a length that makes a valid split of no multiple of 8 samples
        task, _ = build(text_data_bin, "language_modeling", "--arch", "lion_s_lm_tiny", "--tokens-per-sample",
                        str(length))
        task.load_dataset("valid")
        if len(task.dataset("valid")) % 8:
            break
    task.load_dataset("train")
    n = len(task.dataset("valid"))
    with caplog.at_level(logging.WARNING, logger="lion_fairseq.clear_errors"):
        for multiple in (8, 8, 1):  # fairseq reuses a split's iterator: a new one each time
            itr = task.get_batch_iterator(task.dataset("valid"), max_sentences=16, disable_iterator_cache=True,
                                          required_batch_size_multiple=multiple)
            covered = sum(len(b) for b in itr.frozen_batches)
            assert (covered == n) == (multiple == 1), (covered, n)
        task.get_batch_iterator(task.dataset("train"), max_sentences=16, required_batch_size_multiple=8)
    said = [r.getMessage() for r in caplog.records if "leave out" in r.getMessage()]
    assert said == [
        f"fairseq's batches leave out {n % 8} of the {n} samples of 'valid' (--required-batch-size-multiple 8 "
        "drops a last batch of another size: fairseq #5036), the same ones at every evaluation, so its loss and "
        "metrics leave them out too: pass --required-batch-size-multiple 1 to evaluate them all"], said
    # a split of which the run takes no sample (all longer than its limit) is said so, whichever way fairseq
    # failed: an IndexError in its batching (multiple 8), "The dataset is empty" or a division by zero (1)
    shortest = int(min(task.dataset("valid").sizes))
    for multiple in (8, 1):
        with pytest.raises(ValueError, match=rf"fairseq skipped every one of the {n} samples of 'valid': each is "
                                             rf"longer than {shortest - 1} tokens.*"
                                             rf"--tokens-per-sample {shortest - 1} or less"):
            task.get_batch_iterator(task.dataset("valid"), max_sentences=16, max_positions=shortest - 1,
                                    ignore_invalid_inputs=True, disable_iterator_cache=True,
                                    required_batch_size_multiple=multiple)
    # where --max-tokens is the limit, a shorter --tokens-per-sample does not help (it was the advice)
    with pytest.raises(ValueError, match=r"Pass a larger --max-tokens \(8 now\); where the positions end there "
                                         r"too, --tokens-per-sample 8 or less$"):
        task.get_batch_iterator(task.dataset("valid"), max_tokens=8, max_positions=8, ignore_invalid_inputs=True,
                                disable_iterator_cache=True)
    # an LRA task cuts its examples with --max-positions (it has no --tokens-per-sample)
    assert clear_errors.all_skipped_message("valid", 20, 20, "lra_listops").endswith(
        "Pass --max-positions 20 (the task cuts every example to it)")
    # a split of fewer samples than the multiple has no batch for that reason (it was said as all too long)
    task, _ = build(text_data_bin, "language_modeling", "--arch", "lion_s_lm_tiny", "--tokens-per-sample", "1024")
    task.load_dataset("valid")
    n = len(task.dataset("valid"))
    assert 0 < n < 8
    with pytest.raises(ValueError, match=rf"fairseq's batches leave out {n} of the {n} samples of 'valid' "
                                         r"\(--required-batch-size-multiple 8"):
        task.get_batch_iterator(task.dataset("valid"), max_sentences=16, max_positions=1024,
                                disable_iterator_cache=True, required_batch_size_multiple=8)


def test_a_lion_config_is_known_by_its_name_where_the_variant_is_left_to_the_arch():
    """fairseq-hydra-train's ``model._name: lion_lm`` leaves lion_variant unset: the config is still a LION
    model's (a finished run started again under hydra trained on), as its name says; fairseq's are not."""
    from omegaconf import OmegaConf

    for cfg, lion in (({"_name": "lion_lm", "lion_variant": None}, True), ({"_name": "lion_d_tiny"}, True),
                      ({"_name": "transformer_lm"}, False), ({"arch": "lion_s_lm_tiny"}, True)):
        assert clear_errors.is_lion_config(OmegaConf.create(cfg)) is lion, cfg
        assert clear_errors.is_lion_config(cfg) is lion, cfg  # a checkpoint's plain dict
        assert clear_errors.is_lion_config(argparse.Namespace(**cfg)) is lion, cfg
    assert clear_errors.is_lion_config(None) is False
