"""Run the demo's steps as the console commands a user would type (``fairseq-train ...``), each with
its full output in a log file, a few progress lines on the terminal, and a clear error on failure."""
import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

# console script -> the module it runs, for a Python whose bin/ lacks the scripts (e.g. a user site)
FAIRSEQ_MODULES = {"fairseq-train": "fairseq_cli.train", "fairseq-validate": "fairseq_cli.validate",
                   "fairseq-eval-lm": "fairseq_cli.eval_lm"}
REPO_ROOT = Path(__file__).resolve().parents[2]


class DemoError(RuntimeError):
    """A step failed; the message says which, why, and where its full log is."""


def console(name: str) -> List[str]:
    """argv prefix for a fairseq console command, from this interpreter's environment."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", FAIRSEQ_MODULES[name]]


def python_module(module: str) -> List[str]:
    return [sys.executable, "-m", module]


def _quote(arg: str) -> str:
    """shlex quoting, but ``"{'lion_form': 'chunk'}"`` rather than shlex's unreadable form of it."""
    if "'" in arg and not any(c in arg for c in '"$`\\!'):
        return f'"{arg}"'
    return shlex.quote(arg)


def shown(argv: Sequence[str]) -> str:
    """The command as a user would type it: console scripts by name, paths relative to the cwd."""
    argv = list(argv)
    if argv[0] == sys.executable:
        argv[0] = "python"
    elif Path(argv[0]).name in FAIRSEQ_MODULES:
        argv[0] = Path(argv[0]).name
    cwd = Path.cwd()
    out = []
    for a in argv:
        p = Path(a)
        if p.is_absolute():
            try:
                a = str(p.relative_to(cwd)) or "."
            except ValueError:
                pass
        out.append(a)
    return " ".join(_quote(a) for a in out)


def _env(threads: Optional[int]) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads is not None:  # torch in the child reads them as it starts
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    # `python -m preprocess.text` lives in the checkout root, beside lion_fairseq/
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    return env


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End a child the demo is leaving: Ctrl-C first, as a terminal gives it (preprocess removes its staging
    folder on it), then a kill where it has not ended within ``grace_s`` or Ctrl-C comes again."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def run(argv: Sequence[str], log: Path, on_line: Optional[Callable[[str], None]] = None,
        what: str = "command", threads: Optional[int] = None) -> Tuple[str, float]:
    """Run ``argv`` (on ``threads`` CPU threads, if given), writing stdout+stderr to ``log`` and passing each
    line to ``on_line`` (for progress). Returns (the whole output, seconds it took); raises
    :class:`DemoError` with the output's tail when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  $ {shown(argv)}", flush=True)
    lines: List[str] = []
    start = time.time()
    with open(log, "w", encoding="utf-8") as fh:
        fh.write(f"$ {shown(argv)}\n")
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env=_env(threads), bufsize=1)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                fh.write(line)
                lines.append(line)
                if on_line is not None:
                    on_line(line.rstrip("\n"))
            rc = proc.wait()
        except BaseException:  # Ctrl-C: do not leave the child running on its own
            stop(proc)
            raise
    seconds = time.time() - start
    if rc != 0:
        tail = "".join(lines[-25:]).rstrip()
        raise DemoError(f"{what} failed (exit code {rc}) after {seconds:.0f}s; "
                        f"full log: {log}\n--- last lines ---\n{tail}")
    return "".join(lines), seconds


@contextlib.contextmanager
def quiet_logs():
    """Silence INFO/DEBUG logging and warnings of libraries used in this process (fairseq's hub logs
    its whole config, tensorboard and matplotlib log at DEBUG once hydra has configured logging)."""
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def remove_tree(path: Path) -> None:
    """Remove a folder the demo made (missing is fine)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
