"""Write the C example's training data as raw arrays: DIR/images.bin and DIR/labels.bin.

    python examples/export_c/make_data.py DIR --steps 20 --batch-size 8

takes the first STEPS * BATCH digits of the embedded MNIST training split (opgrad.data, in its
fixed order): images.bin is float32 [N][1][28][28] with pixels in [0, 1], labels.bin int64 [N],
both little-endian and C-ordered, exactly what opgrad_train_steps reads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from opgrad.checkpoint import atomic_writer
from opgrad.data import load_embedded_mnist


def write_data(directory: str | os.PathLike[str], steps: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Write the files and return ``(images, labels)`` as written."""
    data = load_embedded_mnist()
    n = steps * batch_size
    if n > len(data.train_labels):
        raise ValueError(f"{steps} steps of {batch_size} need {n} digits; the training split has "
                         f"{len(data.train_labels)}")
    images = np.ascontiguousarray(data.train_images[:n], dtype="<f4")
    labels = np.ascontiguousarray(data.train_labels[:n], dtype="<i8")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, array in (("images.bin", images), ("labels.bin", labels)):
        with atomic_writer(out / name) as handle:
            handle.write(array.tobytes())
    return images, labels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be >= 1")
    try:
        write_data(args.directory, args.steps, args.batch_size)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {args.directory}/images.bin and labels.bin ({args.steps * args.batch_size} digits)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
