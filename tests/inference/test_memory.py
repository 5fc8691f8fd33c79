"""predict/attention split rows and draws into passes that fit a memory budget."""

import pytest
import torch

from probtransformer.inference.posterior.prediction import (
    DEFAULT_MEMORY_BUDGET,
    PredictionEngine,
    activation_bytes,
)


@pytest.fixture
def passes(monkeypatch):
    """Record (draws, rows per pass) of every call of the vectorized runner."""
    seen = []
    run = PredictionEngine._run_vectorized

    def recording(self, flat_draws, x, y, mask, read, batch_size, *rest):
        num = next(iter(flat_draws.values())).shape[0] if flat_draws else 1
        seen.append((num, min(x.shape[0], batch_size)))
        return run(self, flat_draws, x, y, mask, read, batch_size, *rest)

    monkeypatch.setattr(PredictionEngine, "_run_vectorized", recording)
    return seen


def test_a_small_budget_gives_the_same_numbers_in_more_passes(small_posterior, digits, passes):
    x = digits.test.x[:12]
    whole = small_posterior.predict(x, num_samples=10, memory_budget=None)
    assert passes == [(10, 12)]
    cost = activation_bytes(small_posterior.model, x)
    passes.clear()
    split = small_posterior.predict(x, num_samples=10, memory_budget=3 * cost)
    assert passes == [(3, 1), (3, 1), (3, 1), (1, 1)]  # draw chunks, one row per pass
    torch.testing.assert_close(split.probs, whole.probs, rtol=0, atol=1e-6)
    passes.clear()
    att = small_posterior.attention(x[:2], num_samples=10, memory_budget=20 * cost)
    assert passes == [(10, 2)]
    assert att.samples.shape[:3] == (1, 10, 2)


def test_the_default_budget_bounds_rows_of_long_sequences(small_posterior):
    model = small_posterior.model
    short, long = torch.zeros(1, 8, 8), torch.zeros(1, 800, 8)
    assert activation_bytes(model, long) > 1000 * activation_bytes(model, short)  # ~T^2
    # 100 draws of an 800-step sequence: ~4 * 2 heads * 801^2 floats each -> passes of few draws
    per_draw = activation_bytes(model, long)
    assert 100 * per_draw > DEFAULT_MEMORY_BUDGET > per_draw


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, "1GB"])
def test_bad_budgets_are_named(small_posterior, digits, budget):
    with pytest.raises(ValueError, match="memory_budget must be a number of bytes"):
        small_posterior.predict(digits.test.x[:2], num_samples=2, memory_budget=budget)
