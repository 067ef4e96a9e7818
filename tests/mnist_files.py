"""MNIST IDX files written by tests (the format opgrad.data reads)."""

from __future__ import annotations

import struct

import numpy as np


def idx_images(images: np.ndarray) -> bytes:
    """Encode uint8 images (n, rows, cols) as an IDX3 file."""
    n, rows, cols = images.shape
    return struct.pack(">IIII", 0x00000803, n, rows, cols) + images.astype(np.uint8).tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    """Encode uint8 labels (n,) as an IDX1 file."""
    return struct.pack(">II", 0x00000801, len(labels)) + labels.astype(np.uint8).tobytes()
