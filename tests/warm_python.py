"""fairseq's commands, started by the tests, in processes forked from one that has already imported torch and
fairseq.

The suite starts about 160 fairseq commands (``python -m fairseq_cli.train ...``, ``fairseq-train ...``,
``python -m lion_fairseq.demo``), from tests and from the demo and benchmark code they call. Each spent 5-6 s of
CPU importing torch, scikit-learn and fairseq before it read its options (``python -m fairseq_cli.train --help``:
5.5 s on the 2-core CI machine). :func:`install` replaces ``subprocess.Popen`` in the test process, so that such a
command runs as ``__main__`` with the same argv, working directory, environment and file descriptors (pipes,
files, or the test's own), in a process forked from a server that did those imports once: about 1 s each. The
command's process is still a child of the test process (the server's middle process exits, and the test process
is its "subreaper"), so ``wait``, ``poll``, ``kill`` and its exit status are a real process's. It exits as any
Python program does (``atexit`` hooks, then thread shutdown). A ``lion_fairseq`` module started this way starts
its own fairseq commands the same way, and a shell script (a recipe) does given :func:`on_path`'s environment.

Only torch, numpy, scikit-learn and fairseq are imported ahead: the plugin (``--user-dir``) and the rest are
imported by each command as it would be anyway. What fairseq logs as it is imported (that tensorboardX is missing)
is logged once, by the server. A variable that those imports read (threads, CUDA, torch's and Python's own
settings) cannot change in a fork, so each set of their values gets a server of its own. Anything else runs as a
plain subprocess, and so does everything when ``LION_TEST_COLD=1`` (to check that no test depends on this).

Run as a script, this file is the server: it reads requests, each with the three descriptors its command gets,
from the test process on the socket whose descriptor is its first argument, and from stand-ins on the Unix
socket at its second.
"""
import atexit
import ctypes
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional

# read by torch, numpy, OpenMP, BLAS, CUDA or Python as they start or import: a fork cannot change them
READ_AT_IMPORT = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "TRITON_",
                  "PYTHON", "LD_", "MALLOC_", "NUMEXPR_")
BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parent
CONSOLE_SCRIPTS = ("fairseq-train", "fairseq-hydra-train", "fairseq-validate", "fairseq-eval-lm", "fairseq-generate",
                   "fairseq-interactive", "fairseq-preprocess", "fairseq-score")
WARM_MODULES = ("fairseq_cli.", "lion_fairseq.")  # each imports fairseq first (lion_fairseq's __init__ does)


def warm_command(args) -> Optional[List[str]]:
    """``[how, what, *argv]`` for a fairseq command (``module`` and its name, or ``path`` and the console
    script's), or None for anything else."""
    args = [os.fspath(a) for a in args]
    if len(args) >= 3 and args[0] == sys.executable and args[1] == "-m" and args[2].startswith(WARM_MODULES):
        return ["module", args[2], *args[3:]]
    if args and Path(args[0]).parent == BIN and Path(args[0]).name.startswith("fairseq-"):
        return ["path", args[0], *args[1:]]
    return None


def import_time_env(env: Dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(READ_AT_IMPORT) and k != "PYTHONUNBUFFERED"))


class Server:
    def __init__(self, env: Dict[str, str]):
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # where the stand-ins for fairseq's console scripts and `python` (tests/warm_command.py) reach it
        self.dir = Path(tempfile.mkdtemp(prefix="warm-python-"))
        atexit.register(shutil.rmtree, self.dir, True)
        self.bin = self.dir / "bin"
        self.bin.mkdir()
        for name in (*CONSOLE_SCRIPTS, "python"):
            stand_in = self.bin / name
            real = sys.executable if name == "python" else str(BIN / name)  # as warm_command() recognises them
            stand_in.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                                f"import warm_command\nwarm_command.main({real!r})\n")
            stand_in.chmod(0o755)
        # unbuffered, as the tests' commands run: what a command prints before it dies reaches its reader
        self.proc = _Popen([sys.executable, __file__, str(theirs.fileno()), str(self.dir / "socket")],
                           pass_fds=[theirs.fileno()], env=dict(env, PYTHONUNBUFFERED="1"), stdin=subprocess.DEVNULL)
        theirs.close()
        self.lock = threading.Lock()
        if self.socket.recv(64) != b"listening":  # before a stand-in can be started
            raise RuntimeError(f"the tests' fairseq server did not start ({self.proc.wait()}): see the test's stderr")

    def start(self, request: dict, fds: List[int]) -> int:
        """Fork ``request``'s command with ``fds`` as its stdin, stdout and stderr; its pid."""
        with self.lock:
            socket.send_fds(self.socket, [json.dumps(request).encode()], fds)
            answer = self.socket.recv(1 << 16)
        if not answer:
            raise RuntimeError(f"the tests' fairseq server ended ({self.proc.poll()}): see the test's stderr")
        return json.loads(answer)["pid"]


def server(env: Dict[str, str]) -> Server:
    key = import_time_env(env)
    if key not in _servers:
        _servers[key] = Server(env)
    return _servers[key]


_servers: Dict[tuple, Server] = {}
_Popen = subprocess.Popen


class WarmPopen(subprocess.Popen):
    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        command = None
        if not (shell or executable or preexec_fn or pass_fds or gid is not None or gids is not None
                or uid is not None or umask >= 0 or start_new_session or process_group >= 0):
            command = warm_command([args] if isinstance(args, (str, bytes, os.PathLike)) else args)
        if command is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                                          process_group)
        env = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        request = {"command": command, "cwd": os.path.abspath(os.fsdecode(cwd) if cwd else os.getcwd()), "env": env}
        try:
            self.pid = server(env).start(request, fds)
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        # waitpid on a process that is not our child reads as exit status 0: never let that pass
        parent = int(Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if parent != os.getpid():
            raise RuntimeError(f"warm command {self.pid} is the child of {parent}, not of this process")


def install() -> None:
    """Start fairseq's commands warm from now on in this process (see the module's docstring)."""
    if os.environ.get("LION_TEST_COLD") == "1" or not sys.platform.startswith("linux"):
        return
    # PR_SET_CHILD_SUBREAPER: a command whose parent (the server's middle process) exits becomes this process's
    # child, so that it can wait for it as for any subprocess
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
        return
    subprocess.Popen = WarmPopen


def on_path(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` for a shell script (a recipe) whose fairseq commands should start warm: stand-ins for fairseq's
    console scripts and for ``python`` first on its PATH. A stand-in runs its command in a fork of the server for
    ``env``, as the command's parent, and ends as the command ends (with its status, or killed by the same
    signal); given anything else (``python -c``, another ``python -m``, a variable the server read with another
    value), it execs the real command."""
    if subprocess.Popen is not WarmPopen:
        return env
    warm = server(env)
    return dict(env, PATH=os.pathsep.join([str(warm.bin), env.get("PATH", "")]),
                LION_WARM_SOCKET=str(warm.dir / "socket"))


# ---- the server --------------------------------------------------------------------------------------------

def _become(request: dict, fds: List[int]) -> None:
    """Turn this fork into the command (never returns: its exit, or its exception, ends the process)."""
    import logging
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in _set_by_imports.items():
        os.environ.setdefault(name, value)
    # a fresh process has no logging set up: the command's own logging.basicConfig must take effect
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    how, what, *argv = request["command"]
    if what.startswith("lion_fairseq."):
        install()  # the demo's and benchmarks' own fairseq commands
    if how == "module":  # as `python -m` does
        sys.path[0] = request["cwd"]
        sys.argv = [what, *argv]
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    else:  # as `python script` does
        sys.path[0] = os.path.dirname(what)
        sys.argv = [what, *argv]
        runpy.run_path(what, run_name="__main__")
    sys.exit(0)


def _start_for_test_process(requests: socket.socket) -> bool:
    """One request of the test process (WarmPopen): fork its command, hand it over, answer its pid."""
    message, fds, _, _ = socket.recv_fds(requests, 1 << 20, 3)
    if not message:
        return False  # the test process has ended
    request = json.loads(message)
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read)
        _close_server_files()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            _become(request, fds)
        os.write(write, str(pid).encode())
        os._exit(0)
    os.close(write)
    pid = int(os.read(read, 64))
    os.close(read)
    # once the middle process has ended, the command is the test process's child
    os.waitpid(middle, 0)
    for fd in fds:
        os.close(fd)
    requests.send(json.dumps({"pid": pid}).encode())
    return True


def _run_for_stand_in(connection: socket.socket) -> None:
    """In a fork of the server: one stand-in's command, as its parent; its exit status to the stand-in."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message)
    if import_time_env(request["env"]) != _started_with:
        connection.send(b'{"cold": true}')
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        connection.close()
        _become(request, fds)
    for fd in fds:
        os.close(fd)
    connection.send(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    connection.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
    os._exit(0)


_server_files: list = []  # a command started from the server inherits none of them
_started_with: tuple = ()  # the server's import_time_env
_set_by_imports: Dict[str, str] = {}  # variables the imports set where they were unset, as they would in a command


def _close_server_files() -> None:
    for f in _server_files:
        f.close()


def _serve(fd: int, path: str) -> None:
    requests = socket.socket(fileno=fd)
    stand_ins = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stand_ins.bind(path)
    stand_ins.listen()
    requests.send(b"listening")  # stand-ins may connect now: they wait until the imports below are done
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    global _started_with
    before = dict(os.environ)
    _started_with = import_time_env(before)
    # what every fairseq command imports first; nothing runs yet, so that forking stays safe
    import numpy  # noqa: F401
    import sklearn.metrics  # noqa: F401
    import torch  # noqa: F401
    import fairseq.checkpoint_utils  # noqa: F401
    import fairseq.options  # noqa: F401
    import fairseq.trainer  # noqa: F401
    _set_by_imports.update((k, v) for k, v in os.environ.items() if before.get(k) != v)  # scikit-learn's KMP_*

    ready = selectors.DefaultSelector()
    ready.register(requests, selectors.EVENT_READ)
    ready.register(stand_ins, selectors.EVENT_READ)
    _server_files.extend([requests, stand_ins, ready])
    while True:
        for key, _ in ready.select(timeout=1.0):
            if key.fileobj is requests and not _start_for_test_process(requests):
                return
            if key.fileobj is stand_ins:
                connection, _ = stand_ins.accept()
                if os.fork() == 0:
                    _close_server_files()
                    _run_for_stand_in(connection)
                connection.close()
        while True:  # the stand-ins' forks that have ended (a middle process is always waited for at once)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
