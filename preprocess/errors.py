"""User-facing errors, and the wrapper that turns them into one message and an exit code."""
import logging
import os
import signal
import sys
from typing import Callable

EXIT_BAD_INPUT = 1  # argparse itself exits with 2 for bad usage
EXIT_INTERRUPTED = 130


class PreprocessError(Exception):
    """A problem with the user's input or options; the message names the file, line or option."""


_command = {"running": False, "terminated": False}


def _raise_on_sigterm(signum, frame):
    # Turn `kill` into an exception so `finally` blocks remove the staging folder; said once, as a kill of
    # the process group (timeout's) reaches the process twice.
    if not _command["terminated"]:
        print("error: terminated; the unfinished output is being removed", file=sys.stderr, flush=True)
    _command["terminated"] = True
    raise SystemExit(128 + signum)


def _quiet_worker() -> None:
    """In a process forked while a command runs (fairseq's binariser's pool workers): the process group's
    Ctrl-C or kill ends it without a traceback or message of its own; the command says what happened."""
    if _command["running"]:
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(EXIT_INTERRUPTED))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_quiet_worker)


def run_main(body: Callable[[], None]) -> int:
    """Run ``body`` as a command: configure logging, map known failures to exit codes.

    Returns 0 on success, 1 for a :class:`PreprocessError` (message printed to stderr as
    ``error: ...``), 130 when interrupted.
    """
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO, stream=sys.stderr)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    _command.update(running=True, terminated=False)
    try:
        body()
        return 0
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written to --destdir", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        _command["running"] = False
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
