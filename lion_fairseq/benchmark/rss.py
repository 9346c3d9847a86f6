"""Peak resident memory of this process, for the benchmarks that run each measurement in a fresh
process so that the peak is the measurement's own."""
import resource


def maxrss_mib() -> float:
    """The process's peak resident set size so far, in MiB (Linux gives ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Lower the peak to the present resident size (Linux's ``clear_refs``), so that the next
    ``maxrss_mib`` reads the rise from here, not a peak of earlier set-up (a float32 model cast to
    bfloat16 has freed more than its forward pass needs). False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
