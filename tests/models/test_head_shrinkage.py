"""Head-gate shrinkage on a task one head solves: the unneeded heads switch off."""

from __future__ import annotations

import pytest
import torch

from probtransformer import metrics, priors
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_svi
from probtransformer.models import SequenceClassifier

T = 6


def marked_value_task(n: int, seed: int) -> SequenceData:
    """Steps carry ``[value, marker]``; exactly one step is marked; ``y = value there > 0``.

    With mean pooling every position must fetch the marked step's value: attention to the key
    with the marker, which one head does. Random guessing scores 0.5.
    """
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(n, T, generator=g)
    where = torch.randint(0, T, (n,), generator=g)
    marker = torch.zeros(n, T)
    marker[torch.arange(n), where] = 1.0
    y = (value[torch.arange(n), where] > 0).long()
    return SequenceData(torch.stack([value, marker], -1), y)


@pytest.fixture(scope="module")
def gated_fit():
    model = SequenceClassifier(
        2,
        2,
        T,
        d_model=8,
        num_heads=4,
        num_layers=1,
        d_ff=16,
        dropout=0.0,
        head_prior=priors.HeadGatePrior(),
    )
    return fit_svi(model, marked_value_task(400, seed=0), num_steps=1500, lr=1e-2, progress=False)


def test_unneeded_heads_shrink_and_pruning_them_keeps_predictions(gated_fit) -> None:
    test = marked_value_task(400, seed=1)
    gates = gated_fit.head_importance()["mean"]
    # measured, seeds 0 and 1: gates [0.0, 0.21, 0.39, 0.01] and [0.0, 0.0, 0.67, 0.0]; with
    # HeadGatePrior(1.0) instead all four stay in 0.17-0.79 (about 1.6 effective heads)
    assert (gates < 0.05).sum() >= 2
    assert gated_fit.effective_num_heads() < 1.2

    full = gated_fit.predict(test.x, num_samples=50)
    pruned = gated_fit.prune_heads(0.1)
    assert len(pruned.record["pruned_heads"]) >= 2
    small = pruned.predict(test.x, num_samples=50)
    accuracy = metrics.accuracy(full.mean, test.y)
    assert accuracy > 0.9  # the task is learnt
    assert metrics.accuracy(small.mean, test.y) > accuracy - 0.02
    assert metrics.nll(small.mean, test.y) < metrics.nll(full.mean, test.y) + 0.02
