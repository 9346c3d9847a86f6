"""Let fairseq's commands exit with status 0 while its prefetching thread is mid-batch.

fairseq reads batches ahead in a daemon thread (``BackgroundConsumer``, ``--data-buffer-size``, default 10).
When a command ends while that thread is inside a torch op (a collate, say: torch releases the GIL there),
Python before 3.14 ends the thread with ``pthread_exit`` as it takes the GIL back during shutdown; the
unwinding meets a C++ ``noexcept`` frame and the process aborts with "terminate called without an active
exception" (exit status 134) after a run that finished and saved its checkpoints. It happens where data
loading keeps the thread busy: a data-bound run, or one that stops a moment after its iterator starts.

``install()`` (called when the package is imported, i.e. with ``--user-dir lion_fairseq``) registers an
exit hook that runs before Python shuts threads down: each prefetching thread still alive is told to stop
after the batch in hand, its queue is emptied so that it never waits to put one, and it is joined. Only
fairseq's own attributes are used (``_max_len``, ``_queue``); with a fairseq that lacks them nothing is done.
"""
import atexit
import queue
import threading
import time

from fairseq.data.iterators import BackgroundConsumer


def finish_prefetching(timeout: float = 30.0) -> None:
    """Stop every live fairseq prefetching thread after its current batch and wait for it (at most
    ``timeout`` seconds in all: a thread whose source never yields is left as fairseq leaves it)."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if not (isinstance(thread, BackgroundConsumer) and hasattr(thread, "_max_len")
                and isinstance(getattr(thread, "_queue", None), queue.Queue)):
            continue
        thread._max_len = 0  # its loop breaks once the batch in hand is put
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:  # room for that batch and for the end marker after it
                    thread._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(0.01)


def install() -> None:
    """Register ``finish_prefetching`` to run at exit; once, however often it is called."""
    atexit.unregister(finish_prefetching)
    atexit.register(finish_prefetching)
