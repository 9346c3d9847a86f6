"""Peak resident memory of this process, for the benchmarks that run each measurement in a fresh
process so that the peak is the measurement's own."""
import resource


def maxrss_mib() -> float:
    """The process's peak resident set size so far, in MiB (Linux gives ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
