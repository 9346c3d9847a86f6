"""The stand-in for a fairseq console script, or for ``python``, on a recipe's PATH (tests/warm_python.py's
``on_path``): it runs the command in a fork of the warm server, passing it this process's stdin, stdout and
stderr, forwards the signals a shell sends, and ends as the command ends. Anything the server does not run warm
is exec'd as it is. It runs under ``python -S``: warm_python imports nothing beyond Python's own library."""
import json
import os
import signal
import socket
import sys

from warm_python import warm_command


def main(real: str) -> None:
    argv = sys.argv[1:]
    command = warm_command([real, *argv])
    if command is None:
        os.execv(real, [real, *argv])
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.connect(os.environ["LION_WARM_SOCKET"])
        request = {"command": command, "cwd": os.getcwd(), "env": dict(os.environ)}
        socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])
        answer = json.loads(server.recv(1 << 16))
    except (KeyError, OSError, ValueError):  # no server (any more): the command as it is
        answer = {"cold": True}
    if answer.get("cold"):
        os.execv(real, [real, *argv])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, lambda received, _: os.kill(answer["pid"], received))
    status = json.loads(server.recv(1 << 16))["status"]
    if status < 0:  # killed: so is its stand-in, for the shell to see the same
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)
