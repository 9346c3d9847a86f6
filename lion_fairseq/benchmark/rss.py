"""Peak resident memory of this process, for the benchmarks that run each measurement in a fresh
process so that the peak is the measurement's own."""
import ctypes
import gc
import resource


def maxrss_mib() -> float:
    """The process's peak resident set size so far, in MiB: Linux's ``VmHWM``, this process's own (where
    ``ru_maxrss`` starts a child at its parent's peak), else ``ru_maxrss`` (KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Give freed memory back to the system and lower the peak to the present resident size (Linux's
    ``clear_refs``), so that the next ``maxrss_mib`` reads the rise from here: a forward pass would
    otherwise reuse pages that set-up freed (float32 inputs or a model cast to bfloat16) and read as
    needing nothing. False where the kernel does not allow the reset."""
    gc.collect()
    try:  # glibc keeps freed heap pages resident until asked
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
