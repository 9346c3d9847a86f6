"""A small synthetic Pathfinder-like generator, in the LRA release's folder layout.

Pathfinder (Linsley et al. 2018; LRA's Pathfinder and Path-X) shows dashed curves and two round markers:
the label is 1 when one curve joins the two markers and 0 when they sit on different curves. This
generator draws smooth random dashed curves the same way in spirit (it is not the original
generator and its images are simpler), so the whole pipeline runs without the download:

    OUT/curv_baseline/imgs/{b}/sample_{i}.png     grayscale PNG, size x size
    OUT/curv_baseline/metadata/{b}.npy            text despite the name, one line per image:
                                                  "imgs/{b} sample_{i}.png {i} {label}"

which is the release's layout (folder of PNGs, metadata lines with the path in fields 0-1 and the label
in field 3), read by ``python -m preprocess.lra pathfinder``.

    python -m lion_fairseq.lra.pathfinder --output-dir pf32 --size 32 --num 2000
"""
import argparse
import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np


def _curve(rng: np.random.Generator, size: int, length: int, curvature: float) -> np.ndarray:
    """``(length, 2)`` float points of a smooth random walk of unit steps that turns back at the border."""
    margin = 2.0
    pos = rng.uniform(margin, size - 1 - margin, 2)
    heading = rng.uniform(0, 2 * math.pi)
    points = [pos.copy()]
    for _ in range(length - 1):
        heading += rng.normal(0.0, curvature)
        step = np.array([math.sin(heading), math.cos(heading)])
        nxt = pos + step
        if not (margin <= nxt[0] <= size - 1 - margin and margin <= nxt[1] <= size - 1 - margin):
            heading += math.pi  # bounce off the border instead of leaving the image
            nxt = pos - step
        pos = nxt
        points.append(pos.copy())
    return np.stack(points)


def _draw_curve(img: np.ndarray, points: np.ndarray, dash: int, gap: int) -> None:
    for i, (r, c) in enumerate(points):
        if i % (dash + gap) < dash:
            img[int(round(r)), int(round(c))] = 255


def _draw_marker(img: np.ndarray, point: np.ndarray, radius: float = 1.5) -> None:
    size = img.shape[0]
    rr, cc = np.mgrid[0:size, 0:size]
    img[(rr - point[0]) ** 2 + (cc - point[1]) ** 2 <= radius ** 2] = 255


def sample(rng: np.random.Generator, size: int = 32, connected: Optional[bool] = None, *,
           curve_length: Optional[int] = None, curvature: float = 0.25, distractors: int = 1,
           dash: int = 3, gap: int = 1) -> Tuple[np.ndarray, int]:
    """One ``(size, size)`` uint8 image and its label (1: the markers are joined by one curve)."""
    if connected is None:
        connected = bool(rng.integers(2))
    length = curve_length or int(1.5 * size)
    img = np.zeros((size, size), dtype=np.uint8)
    curves = [_curve(rng, size, length, curvature) for _ in range(1 if connected else 2)]
    others = [_curve(rng, size, length, curvature) for _ in range(distractors + (1 if connected else 0))]
    for c in curves + others:
        _draw_curve(img, c, dash, gap)
    if connected:
        ends = [curves[0][0], curves[0][-1]]
    else:
        ends = [curves[0][0], curves[1][-1]]
    for e in ends:
        _draw_marker(img, e)
    return img, int(connected)


# the sub-folder written: the one LRA reports and ``python -m preprocess.lra pathfinder`` reads by default
DIFFICULTY = "curv_contour_length_14"


def write_release(output_dir: Path, num: int, size: int = 32, per_folder: int = 1000, seed: int = 0,
                  difficulty: str = DIFFICULTY, **kwargs) -> List[Tuple[Path, int]]:
    """Write ``num`` images and their metadata under ``output_dir/difficulty``; returns (path, label)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = output_dir / difficulty
    (root / "metadata").mkdir(parents=True, exist_ok=True)
    written = []
    for b in range(math.ceil(num / per_folder)):
        folder = root / "imgs" / str(b)
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for i in range(b * per_folder, min(num, (b + 1) * per_folder)):
            img, label = sample(rng, size, **kwargs)
            Image.fromarray(img, mode="L").save(folder / f"sample_{i}.png")
            lines.append(f"imgs/{b} sample_{i}.png {i} {label}")
            written.append((folder / f"sample_{i}.png", label))
        (root / "metadata" / f"{b}.npy").write_text("\n".join(lines) + "\n")
    return written


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lion_fairseq.lra.pathfinder", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output-dir", required=True, type=Path)
    p.add_argument("--num", type=int, default=2000, help="images to draw (half connected on average)")
    p.add_argument("--size", type=int, default=32, help="image side: 32 for Pathfinder, 128 for Path-X")
    p.add_argument("--curve-length", type=int, default=None, help="pixels per curve (default 1.5 x size)")
    p.add_argument("--distractors", type=int, default=1, help="extra curves without markers")
    p.add_argument("--per-folder", type=int, default=1000)
    p.add_argument("--difficulty", default=DIFFICULTY, help="sub-folder name, as in the release")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.size < 8:
        p.error("--size must be at least 8")
    written = write_release(args.output_dir, args.num, args.size, args.per_folder, args.seed, args.difficulty,
                            curve_length=args.curve_length, distractors=args.distractors)
    positives = sum(label for _, label in written)
    print(f"{args.output_dir / args.difficulty}: {len(written)} images of {args.size}x{args.size}, "
          f"{positives} connected", file=sys.stderr)


if __name__ == "__main__":
    main()
