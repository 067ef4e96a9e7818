"""Training-image augmentation: integer shifts and the random affine map agree with their geometry,
are drawn per step from the run's seed, and are validated."""

from __future__ import annotations

import numpy as np
import pytest

from opgrad import nn
from opgrad.nn.trainer import affine_images, shift_images


class FixedDraws:
    """A stand-in generator whose uniform draws are given: angle, scale, then (dy, dx)."""

    def __init__(self, degrees: float, scale: float, dy: float, dx: float) -> None:
        self.values = [np.array([degrees]), np.array([scale]), np.array([[dy], [dx]])]

    def uniform(self, low: float, high: float, size: object = None) -> np.ndarray:
        return self.values.pop(0)


def _dot(y: int, x: int, size: int = 7) -> np.ndarray:
    image = np.zeros((1, 1, size, size), np.float32)
    image[0, 0, y, x] = 1.0
    return image


def test_identity_and_integer_translation_are_exact() -> None:
    images = np.random.default_rng(0).random((4, 2, 9, 9), dtype=np.float32)
    np.testing.assert_array_equal(affine_images(images, np.random.default_rng(1), 0, 0, 0), images)
    moved = affine_images(_dot(3, 3), FixedDraws(0, 1, 1, -2), 0, 0, 2)  # type: ignore[arg-type]
    np.testing.assert_array_equal(moved, _dot(4, 1))


def test_rotation_by_a_quarter_turn_and_scaling_about_the_centre() -> None:
    quarter = affine_images(_dot(0, 3), FixedDraws(90, 1, 0, 0), 90, 0, 0)  # type: ignore[arg-type]
    np.testing.assert_allclose(quarter, _dot(3, 6), atol=1e-6)
    doubled = affine_images(_dot(2, 3), FixedDraws(0, 2, 0, 0), 0, 0.5, 0)  # type: ignore[arg-type]
    np.testing.assert_allclose(doubled[0, 0, 1, 3], 1.0, atol=1e-6)  # one pixel from the centre -> two
    half = affine_images(np.ones((1, 1, 8, 8), np.float32), FixedDraws(0, 0.5, 0, 0), 0, 0.5, 0)  # type: ignore[arg-type]
    assert half[0, 0, 0, 0] == 0 and half[0, 0, 4, 4] == 1  # shrunk: zero fill around the image


def test_draws_depend_on_seed_and_step_only() -> None:
    model = nn.mlp(hidden=(8,))
    images = np.random.default_rng(0).random((6, 1, 28, 28), dtype=np.float32)
    a = nn.Trainer(model, nn.SGD(), seed=3, augment_shift=2, augment_rotate=10, augment_scale=0.1)
    b = nn.Trainer(model, nn.SGD(), seed=3, augment_shift=2, augment_rotate=10, augment_scale=0.1)
    np.testing.assert_array_equal(a.augment(images, 5), b.augment(images, 5))
    assert not np.array_equal(a.augment(images, 5), a.augment(images, 6))
    shifts_only = nn.Trainer(model, nn.SGD(), seed=3, augment_shift=2)
    np.testing.assert_array_equal(shifts_only.augment(images, 5),
                                  shift_images(images, np.random.default_rng(np.random.PCG64([3, 0x73686966, 5])), 2))


@pytest.mark.parametrize(("option", "value", "message"), [
    ("augment_rotate", -1.0, r"augment_rotate must be degrees in \[0, 180\]"),
    ("augment_scale", 1.0, r"augment_scale must be a fraction in \[0, 1\)"),
])
def test_trainer_refuses_bad_ranges(option: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        nn.Trainer(nn.mlp(hidden=(8,)), nn.SGD(), **{option: value})  # type: ignore[arg-type]


def test_cli_range_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from opgrad import cli

    for option, value in (("--augment-rotate", "200"), ("--augment-scale", "1.5"), ("--augment-scale", "nan")):
        assert cli.main(["train", option, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert option in err and f"got '{value}'" in err


def test_shifts_move_each_image_by_its_own_draw_with_zeros_coming_in() -> None:
    # Image i shows the input from (dy[i], dx[i]) on (the draws, in that order, in [-k, k]):
    # out[y, x] = in[y + dy, x + dx], zero where that falls outside, on every channel alike.
    images = np.random.default_rng(2).random((9, 2, 5, 6), dtype=np.float32) + 1
    shifted = shift_images(images, np.random.default_rng(4), 2)
    draws = np.random.default_rng(4)
    dy, dx = draws.integers(-2, 3, size=9), draws.integers(-2, 3, size=9)
    assert shifted.shape == images.shape and shifted.flags.c_contiguous
    h, w = images.shape[2:]
    for i in range(9):
        want = np.zeros_like(images[i])
        for y in range(h):
            for x in range(w):
                if 0 <= y + dy[i] < h and 0 <= x + dx[i] < w:
                    want[:, y, x] = images[i, :, y + dy[i], x + dx[i]]
        np.testing.assert_array_equal(shifted[i], want)
    assert shift_images(images, np.random.default_rng(4), 0) is images
