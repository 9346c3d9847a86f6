"""The demo (the README's main command) end to end at a tiny budget, a second run that reuses the
workdir, and its refusals; plus the corpus and prompt helpers it is built on."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

FORMS = ("parallel", "chunk", "recurrent")
# a tiny budget: the time limit is a backstop, the update cap ends each training (10: one point of
# the training curve, fairseq logs every 10 updates)
DEMO_ARGS = ["--minutes", "2", "--max-update", "10", "--batch-size", "8"]


def demo(workdir: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """``python -m lion_fairseq.demo`` in a subprocess, as the README's command runs it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run([sys.executable, "-m", "lion_fairseq.demo", "--workdir", str(workdir), *args], cwd=ROOT,
                          env=env, text=True, capture_output=True, timeout=900)
    if ok:
        assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return proc


def losses(out: str) -> dict:
    """{(model, form): loss} from the demo's per-form lines, e.g. ``MLM chunk     loss 9.8280``."""
    found = {}
    for model, form, value in re.findall(r"^\s+(MLM|LM)\s+(parallel|chunk|recurrent)\s+loss ([0-9.]+)", out, re.M):
        found[(model, form)] = float(value)
    return found


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo") / "work"
    return workdir, demo(workdir, *DEMO_ARGS).stdout


def test_demo_end_to_end(first_run):
    workdir, out = first_run
    # each step ran the fairseq command a user would type
    for command in ("python -m preprocess.text", "fairseq-train", "fairseq-validate", "fairseq-eval-lm"):
        assert f"$ {command}" in out, command
    assert out.count("$ fairseq-train") == 2 and "--tensorboard-logdir" in out

    # validation loss of both models in every form; the forms compute the same function
    found = losses(out)
    assert set(found) == {(m, f) for m in ("MLM", "LM") for f in FORMS}, found
    uniform = float(re.search(r"uniform guess: ([0-9.]+)", out).group(1))
    for model in ("MLM", "LM"):
        row = [found[(model, f)] for f in FORMS]
        assert max(row) - min(row) <= 2e-3, (model, row)
        assert 1.0 < row[0] < uniform + 4, (model, row)  # 10 updates: a real loss, near the uniform guess

    # the mask filled through the hub interface: the prompt's <mask> replaced, with probabilities
    results = json.loads((workdir / "results.json").read_text())
    top = results["fill_mask"]["top"]
    assert top and all("<mask>" not in t["filled"] and 0.0 < t["prob"] <= 1.0 for t in top)
    assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
    assert f"fill-mask: {results['fill_mask']['input']}" in out and top[0]["filled"] in out

    # a continuation decoded recurrently: the prompt, then new text
    prompt, sampled = results["generate"]["prompt"], results["generate"]["sampled"]
    assert sampled.startswith(prompt) and len(sampled) > len(prompt) + 3 and f"sampled (top-10): {sampled}" in out
    assert results["generate"]["beam"].startswith(prompt)

    # loss curves: a PNG next to the tensorboard logs, drawn from them
    png = workdir / "tensorboard" / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for model in ("mlm", "lm"):
        assert results[model]["curves_from"] == "tensorboard"
        assert list((workdir / "tensorboard" / model / "train_inner").glob("events.out.tfevents.*"))
        assert results[model]["updates"] == 10
    assert results["mlm"]["valid_loss_bits"]["recurrent"] == found[("MLM", "recurrent")]


def test_demo_second_run_reuses_the_workdir(first_run):
    workdir, out = first_run
    first = json.loads((workdir / "results.json").read_text())
    again = demo(workdir, *DEMO_ARGS).stdout
    assert "$ " not in again, "a second run with the same options ran a command again"
    assert again.count("reusing") == 3 and again.count("(reused; same checkpoint)") == 6
    assert re.search(r"demo took \d+ s$", again.rstrip()), again[-200:]  # not "0.0 min"
    assert losses(again) == losses(out)
    # the hub steps run again (cheap, in this process) with the same seed: the same text
    assert "sampled (top-10): " + first["generate"]["sampled"] in again


def test_demo_scores_a_checkpoint_that_changed_again(first_run):
    """An evaluation is reused only for the checkpoint it scored. A model retrained (after Ctrl-C, or a lost
    file) by the same command is another checkpoint, as training runs for --minutes: its losses were those of
    the checkpoint before, printed as "(reused; same checkpoint)"."""
    import torch

    workdir, out = first_run
    path = workdir / "lm" / "checkpoint_best.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    torch.manual_seed(0)
    for name, tensor in state["model"].items():
        if tensor.is_floating_point():
            tensor.add_(torch.randn_like(tensor) * 0.5)
    torch.save(state, path)
    again = demo(workdir, *DEMO_ARGS).stdout
    assert again.count("(reused; same checkpoint)") == 3 and "$ fairseq-eval-lm" in again  # the MLM's reused
    assert all(losses(again)[("LM", f)] != losses(out)[("LM", f)] for f in FORMS), (losses(again), losses(out))


def test_demo_commands_stop_as_ctrl_c_stops_them_and_get_the_threads_asked(tmp_path):
    """A child the demo leaves (Ctrl-C) gets Ctrl-C first: preprocess removes its staging folder on it, and
    was killed outright (a hidden .data-bin.partial-* left beside the data). --threads reaches every command."""
    from lion_fairseq.demo.commands import run

    cleaned = tmp_path / "cleaned"
    child = ("import signal, sys, time\n"
             f"signal.signal(signal.SIGINT, lambda *a: (open({str(cleaned)!r}, 'w').close(), sys.exit(130)))\n"
             "print('started', flush=True)\n"
             "time.sleep(60)\n")

    def interrupt(line: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run([sys.executable, "-c", child], tmp_path / "child.log", on_line=interrupt)
    assert cleaned.exists()
    out, _ = run([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"], tmp_path / "t.log",
                 threads=3)
    assert out.strip() == "3"


def test_demo_refuses_bad_options_and_foreign_folders(tmp_path, capsys):
    from lion_fairseq.demo.cli import main

    (tmp_path / "a_file").write_text("")
    cases = [
        # a folder that cannot be made: one line, not a traceback
        (["--workdir", str(tmp_path / "a_file" / "w")], "Not a directory (pass a --workdir you can write to)"),
        (["--corpus", str(tmp_path / "missing.txt")], "--corpus: no such file"),
        (["--minutes", "0"], "--minutes must be a positive number"),
        (["--seed", "-1"], "--seed must be in 0..4294967295"),
        (["--corpus", str(tmp_path)], f"--corpus: {tmp_path} is a folder: pass its text files"),
        (["--mask-prompt", "no mask here"], "--mask-prompt needs exactly one <mask>"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            main(["--workdir", str(tmp_path / "w"), *args])
        assert e.value.code == 1
        assert message in capsys.readouterr().err
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit):
        main(["--workdir", str(foreign), "--fresh"])
    assert "was not made by the demo" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"
    # a demo's folder that holds the user's --corpus: --fresh removed both, then found no corpus
    from lion_fairseq.demo.workdir import MARKER

    (foreign / MARKER).write_text("")
    with pytest.raises(SystemExit):
        main(["--workdir", str(foreign), "--fresh", "--corpus", str(foreign / "notes.txt")])
    assert f"--corpus {foreign / 'notes.txt'} lies inside --workdir {foreign}, which --fresh removes" in \
        capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"
    from lion_fairseq.demo.cli import build_parser, check_args

    check_args(build_parser().parse_args(["--workdir", str(foreign), "--corpus", str(foreign / "notes.txt")]))


def test_run_sh_demo_reads_relative_paths_from_the_callers_folder(tmp_path):
    """``bash run.sh demo --corpus FILE`` from another folder: run.sh changes into the checkout to set up its
    environment, and the demo then looked for FILE (and put --workdir) there."""
    (tmp_path / "one.txt").write_text("one line is too little text to hold out a validation split\n")
    # run.sh beside an environment script that sets up nothing (the real one would install a .venv)
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "run.sh", checkout)
    (checkout / "scripts" / "env.sh").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    proc = subprocess.run(["bash", str(checkout / "run.sh"), "demo", "--corpus", "one.txt", "--workdir", "w"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    # found, and preprocessing (one line leaves nothing to train on) stopped it, in the folder asked for
    assert proc.returncode == 1 and "--input has 1 line" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "w" / "logs" / "preprocess.log").is_file()


def test_corpus_and_prompts(tmp_path):
    from lion_fairseq.demo.corpus import PYDOC_LM_PROMPT, PYDOC_MASK_PROMPT, prompts_from_text, pydoc_paragraphs

    lines = pydoc_paragraphs()
    text = "\n".join(lines)
    assert len(lines) > 1000 and "" in lines  # topics apart
    assert not any(re.fullmatch(r"[*=~^-]{3,}", line) for line in lines)  # headings' underlines gone
    # the default prompts come from the training text, so a few minutes of training have seen them
    assert PYDOC_MASK_PROMPT.replace("<mask>", "objects") in text and PYDOC_LM_PROMPT in text
    f = tmp_path / "mine.txt"
    f.write_text("one two three four five six seven eight nine\nshort line\nalpha beta gamma delta eps zeta eta theta\n")
    masked, prompt = prompts_from_text([f])
    assert masked == "alpha beta gamma delta <mask> zeta eta theta"
    assert prompt == "one two three four"
