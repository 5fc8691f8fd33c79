import struct

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from probtransformer.metrics import ece
from probtransformer.plots import attention_figure, reliability_figure, save_figure

NUM_LAYERS, NUM_HEADS, T = 2, 3, 5


@pytest.fixture(scope="module")
def attention() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    mean = rng.dirichlet(np.ones(T), size=(NUM_LAYERS, NUM_HEADS, T))  # (layer, head, query, key)
    std = rng.uniform(0.0, 0.1, size=mean.shape)
    return mean, std


def _images(fig: Figure) -> list:
    return [image for ax in fig.axes for image in ax.images]


def _png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_attention_figure_layout(attention):
    mean, std = attention
    fig = attention_figure(torch.tensor(mean), std, key_labels=list("abcde"), title="example 0")
    assert isinstance(fig, Figure)
    heatmaps = 2 * NUM_LAYERS * NUM_HEADS
    assert len(_images(fig)) == heatmaps
    assert len(fig.axes) == heatmaps + 2  # one colorbar per panel
    mean_panel, std_panel = fig.subfigs
    np.testing.assert_allclose(mean_panel.axes[0].images[0].get_array(), mean[0, 0])
    np.testing.assert_allclose(std_panel.axes[0].images[0].get_array(), std[0, 0])
    titles = [ax.get_title() for ax in mean_panel.axes]
    assert "layer 1 · head 2" in titles
    bottom_left = mean_panel.axes[NUM_HEADS * (NUM_LAYERS - 1)]
    assert bottom_left.get_xlabel() == "key" and bottom_left.get_ylabel() == "query"
    assert [t.get_text() for t in bottom_left.get_xticklabels()] == list("abcde")


def test_attention_figure_rejects_bad_inputs(attention):
    mean, std = attention
    with pytest.raises(ValueError, match=r"mean must have shape \(layer, head, query, key\)"):
        attention_figure(mean[0], std[0])
    with pytest.raises(ValueError, match="std must have the shape of mean"):
        attention_figure(mean, std[:1])
    with pytest.raises(ValueError, match="std must be >= 0"):
        attention_figure(mean, -std)
    with pytest.raises(ValueError, match="query_labels must have 5 entries"):
        attention_figure(mean, std, query_labels=["a"])


def test_reliability_figure(tmp_path):
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(10, 0.5), size=300)
    y = rng.integers(0, 10, size=300)
    fig = reliability_figure(torch.tensor(probs), torch.tensor(y), n_bins=10, title="digits")
    diagram, histogram = fig.axes
    assert len(diagram.patches) == 10 and len(histogram.patches) == 10
    assert f"ECE = {ece(probs, y, n_bins=10):.3f}" in diagram.get_title()
    heights = [bar.get_height() for bar in histogram.patches]
    assert sum(heights) == 300


def test_save_figure_writes_png(tmp_path, attention):
    fig = attention_figure(*attention)
    path = save_figure(fig, tmp_path / "figures" / "attention.png")
    assert path.stat().st_size > 1000
    width, height = _png_size(path)
    fig_width, fig_height = fig.get_size_inches()
    assert (width, height) == (round(fig_width * 120), round(fig_height * 120))
    with pytest.raises(ValueError, match=r"path must end in '\.png'"):
        save_figure(fig, tmp_path / "attention.jpg")
