"""Progress on long work: a tqdm bar on a terminal, a log line every ``every_s`` seconds otherwise,
and a heartbeat around long library calls (sentencepiece training, fairseq's binariser)."""
import logging
import threading
import time
from typing import Callable, List, TypeVar

log = logging.getLogger("preprocess")
T = TypeVar("T")


class Progress:
    """Count work done; draw a bar when stderr is a terminal, else log now and then (e.g. in batch logs)."""

    def __init__(self, total: int, desc: str, unit: str = "lines", every_s: float = 30.0):
        from tqdm import tqdm

        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.done = 0
        self.start = self.last = time.time()
        self.bar = tqdm(total=total, desc=desc, unit=f" {unit}", disable=None, mininterval=1.0)

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        now = time.time()
        if self.bar.disable and now - self.last >= self.every_s:
            self.last = now
            log.info("%s: %d/%d %s (%.0fs)", self.desc, self.done, self.total, self.unit, now - self.start)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def call_with_heartbeat(fn: Callable[[], T], what: str, every_s: float = 30.0) -> T:
    """Run ``fn`` in a daemon thread, logging "<what> still running" every ``every_s`` seconds.

    The calling thread keeps receiving Ctrl-C / SIGTERM (the libraries we call release the GIL or
    work in child processes), so an interrupted run can still clean up; ``fn``'s exception is re-raised.
    """
    result: List[T] = []
    failure: List[BaseException] = []

    def work() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # handed to the calling thread
            failure.append(e)

    start = time.time()
    worker = threading.Thread(target=work, name=what, daemon=True)
    worker.start()
    while True:
        worker.join(timeout=every_s)
        if not worker.is_alive():
            break
        log.info("%s still running (%.0fs)", what, time.time() - start)
    if failure:
        raise failure[0]
    return result[0]
