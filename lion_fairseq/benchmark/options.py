"""Command-line value types the benchmarks share."""
import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (a length, a thread count, a number of repeats or updates), else argparse's usage
    error naming the option."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {value}")
    return value
