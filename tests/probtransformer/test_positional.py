"""Sinusoidal positional encodings: the 1-D code of Vaswani et al. and 2-D codes of patch grids."""

import math

import numpy as np
import pytest
import torch

from probtransformer.datasets import load
from probtransformer.inference import fit_svi
from probtransformer.models import SequenceClassifier
from probtransformer.positional import SinusoidalPositionalEncoding, sinusoid_table

D, ROWS, COLS = 16, 4, 4


def _reference(positions: int, dim: int) -> np.ndarray:
    """The original formula in float64: PE[t, 2i] = sin(t / 10000^(2i/d)), PE[t, 2i+1] = cos."""
    pe = np.zeros((positions, dim))
    for t in range(positions):
        for i in range(0, dim, 2):
            angle = t / 10000 ** (i / dim)
            pe[t, i] = math.sin(angle)
            if i + 1 < dim:
                pe[t, i + 1] = math.cos(angle)
    return pe


# -- 1-D ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [16, 10, 7])
def test_one_dimensional_table_is_the_original_formula(dim):
    table = sinusoid_table(50, dim)
    assert table.shape == (50, dim) and table.dtype == torch.float32
    np.testing.assert_allclose(table.numpy(), _reference(50, dim), atol=2e-5, rtol=0)


def test_one_dimensional_encoding_adds_the_table_to_the_input():
    enc = SinusoidalPositionalEncoding(D, 12)
    h = torch.randn(3, 2, 9, D)  # (s, N, T, d) with T < max_len
    out = enc(h)
    torch.testing.assert_close(out - h, sinusoid_table(12, D)[:9].expand_as(h))
    # every position gets a different code
    assert torch.cdist(enc.pe, enc.pe).add(torch.eye(12)).min() > 1e-3


def test_one_dimensional_leading_steps_shift_the_positions():
    """Without a grid, a CLS step is simply position 0 of a table one longer (unchanged)."""
    enc = SinusoidalPositionalEncoding(D, 12, leading=1)
    torch.testing.assert_close(enc.pe, sinusoid_table(13, D))


# -- 2-D ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grid_code() -> torch.Tensor:
    return SinusoidalPositionalEncoding(D, ROWS * COLS, grid=(ROWS, COLS)).pe


def test_two_dimensional_code_rows_share_the_first_half_columns_the_second(grid_code):
    assert grid_code.shape == (ROWS * COLS, D)
    half = D // 2
    for a in range(ROWS * COLS):
        for b in range(ROWS * COLS):
            same_row = a // COLS == b // COLS
            same_col = a % COLS == b % COLS
            assert torch.equal(grid_code[a, :half], grid_code[b, :half]) == same_row, (a, b)
            assert torch.equal(grid_code[a, half:], grid_code[b, half:]) == same_col, (a, b)


def test_two_dimensional_code_halves_are_one_dimensional_codes(grid_code):
    half = D // 2
    rows = torch.arange(ROWS * COLS) // COLS
    cols = torch.arange(ROWS * COLS) % COLS
    torch.testing.assert_close(grid_code[:, :half], sinusoid_table(ROWS, half)[rows])
    torch.testing.assert_close(grid_code[:, half:], sinusoid_table(COLS, half)[cols])


def test_non_square_grid_is_row_major():
    pe = SinusoidalPositionalEncoding(8, 6, grid=(2, 3)).pe  # patches 0 1 2 / 3 4 5
    torch.testing.assert_close(pe[4, :4], pe[3, :4])  # same row
    torch.testing.assert_close(pe[4, 4:], pe[1, 4:])  # same column
    assert not torch.allclose(pe[4, :4], pe[1, :4])


def test_cls_leading_step_gets_a_zero_code(grid_code):
    enc = SinusoidalPositionalEncoding(D, ROWS * COLS, grid=(ROWS, COLS), leading=1)
    assert enc.pe.shape == (ROWS * COLS + 1, D)
    assert torch.equal(enc.pe[0], torch.zeros(D))
    torch.testing.assert_close(enc.pe[1:], grid_code)
    h = torch.ones(2, ROWS * COLS + 1, D)
    out = enc(h)
    assert torch.equal(out[:, 0], h[:, 0])  # the CLS step is left as it is


@pytest.mark.parametrize(
    "d_model, max_len, grid, match",
    [
        (16, 16, (4, 3), "patches"),
        (16, 15, (4, 4), "patches"),
        (10, 16, (4, 4), "divisible by 4"),
        (6, 4, (2, 2), "divisible by 4"),
    ],
)
def test_bad_grid_or_width_raises(d_model, max_len, grid, match):
    with pytest.raises(ValueError, match=match):
        SinusoidalPositionalEncoding(d_model, max_len, grid=grid)


# -- SequenceClassifier with 2-D positions -----------------------------------------------------

SIZES = dict(d_model=16, num_heads=2, num_layers=1, d_ff=16, dropout=0.0)


@pytest.fixture(scope="module")
def patches():
    return load("digits-patches")


def test_classifier_with_a_grid_uses_two_dimensional_positions():
    model = SequenceClassifier(4, 10, 16, grid=(4, 4), **SIZES)
    assert model.config["grid"] == [4, 4]
    torch.testing.assert_close(
        model.embedding.positional.pe,
        SinusoidalPositionalEncoding(16, 16, grid=(4, 4)).pe,
    )
    rebuilt = SequenceClassifier.from_config(model.config)
    torch.testing.assert_close(rebuilt.embedding.positional.pe, model.embedding.positional.pe)
    cls = SequenceClassifier(4, 10, 16, grid=(4, 4), pooling="cls", **SIZES)
    assert torch.equal(cls.embedding.positional.pe[0], torch.zeros(16))
    plain = SequenceClassifier(4, 10, 16, **SIZES)
    assert "grid" not in plain.config


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(grid=(4, 3)),
        dict(grid=(4,)),
        dict(grid=(4, 0)),
        dict(grid=(4, 4), d_model=18, num_heads=2),
    ],
)
def test_classifier_rejects_bad_grids(kwargs):
    with pytest.raises(ValueError):
        SequenceClassifier(4, 10, 16, **{**SIZES, **kwargs})


def test_classifier_with_a_grid_fits_digits_patches(patches):
    meta = patches.meta
    assert tuple(meta["grid"]) == (4, 4) and meta["max_len"] == 16 and meta["in_features"] == 4
    model = SequenceClassifier(
        meta["in_features"], 10, meta["max_len"], grid=tuple(meta["grid"]), **SIZES
    )
    post = fit_svi(
        model, patches.train[:300], num_steps=60, lr=3e-2, batch_size=100, seed=0, progress=False
    )
    test = patches.test[:200]
    pred = post.predict(test.x, num_samples=8, seed=0)
    assert pred.probs.shape == (8, 200, 10)
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(8, 200))
    accuracy = (pred.predicted == test.y).float().mean().item()
    assert accuracy > 0.3  # chance is 0.1
