"""Log-log plots of a measurement against sequence length, shared by the benchmarks."""
from typing import Dict, Optional


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed (the ``demo``
    extra); the plots are then skipped and the tables still written."""
    try:
        import logging

        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # importing fairseq sets the root to DEBUG
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def against_length(ax, series: Dict[str, Dict[int, Dict]], key: str, title: str,
                   dashed: Optional[str] = None) -> None:
    """One line per series of ``{L: {key: value}}``, log-log; names containing ``dashed`` dashed."""
    for name, per_len in series.items():
        pts = [(L, r[key]) for L, r in sorted(per_len.items()) if r.get(key)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name,
                    linestyle="--" if dashed and dashed in name else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
