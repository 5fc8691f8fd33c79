"""SVI as state plus step: ``svi_init`` / ``svi_step`` give ``fit_svi``'s numbers, and a state
saved after k steps and restored continues to them."""

from __future__ import annotations

import pyro
import pytest
import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference import (
    NonFiniteELBOError,
    SVIState,
    fit_svi,
    restore_svi_checkpoint,
    save_svi_checkpoint,
    svi_init,
    svi_step,
)
from probtransformer.models import SequenceClassifier

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8)
SETTINGS = dict(num_steps=12, batch_size=16, lr=1e-2, seed=3)
N = 40


@pytest.fixture(scope="module")
def data() -> SequenceData:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 5, 3, generator=g)  # (N, T, F)
    mask = torch.ones(N, 5, dtype=torch.bool)
    mask[::3, 3:] = False
    return SequenceData(x, (x[:, 0, 0] > 0).long(), mask)


def _model() -> SequenceClassifier:
    return SequenceClassifier(3, 2, 5, **TINY)


def _states(model: torch.nn.Module, guide: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        **{f"model.{k}": v for k, v in model.state_dict().items()},
        **{f"guide.{k}": v for k, v in guide.state_dict().items()},
    }


def _assert_same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("guide", ["normal", "delta"])
def test_a_loop_of_steps_is_fit_svi(data, guide):
    fitted = fit_svi(_model(), data, guide=guide, progress=False, **SETTINGS)
    state = svi_init(_model(), data, guide=guide, device="cpu", **SETTINGS)
    assert isinstance(state, SVIState) and state.step == 0 and state.elbo == []
    assert state.order.shape == (N,)
    values = [svi_step(state) for _ in range(SETTINGS["num_steps"])]
    assert values == state.elbo == fitted.record["elbo"]
    assert state.step == SETTINGS["num_steps"]
    _assert_same_parameters(_states(state.model, state.guide), _states(fitted.model, fitted.guide))


def test_steps_walk_a_permutation_and_reshuffle_at_the_epoch_end(data):
    state = svi_init(_model(), data, device="cpu", **SETTINGS)
    first = state.order.clone()
    assert torch.equal(first.sort().values, torch.arange(N))
    svi_step(state)
    svi_step(state)  # 32 of 40 sequences used: 8 left, fewer than a batch of 16
    assert state.cursor == 32 and torch.equal(state.order, first)
    svi_step(state)
    assert state.cursor == 16 and not torch.equal(state.order, first)
    assert torch.equal(state.order.sort().values, torch.arange(N))


def test_a_step_leaves_the_callers_rng_and_param_store_alone(data):
    state = svi_init(_model(), data, device="cpu", **SETTINGS)
    pyro.param("mine", torch.tensor(1.5))
    rng = torch.get_rng_state()
    svi_step(state)
    assert torch.equal(torch.get_rng_state(), rng)
    assert list(pyro.get_param_store().keys()) == ["mine"]
    assert pyro.param("mine").item() == 1.5


WARMUP_COSINE = dict(lr_warmup=1 / 3, lr_schedule="cosine", lr_decay=0.0)  # 4 of 12 steps


@pytest.mark.parametrize("schedule", [{}, WARMUP_COSINE], ids=["exponential", "warmup-cosine"])
@pytest.mark.parametrize("k", [0, 5, 7])
def test_a_state_saved_after_k_steps_continues_to_the_same_numbers(data, tmp_path, k, schedule):
    settings = SETTINGS | schedule
    reference = svi_init(_model(), data, device="cpu", **settings)
    for _ in range(SETTINGS["num_steps"]):
        svi_step(reference)
    state = svi_init(_model(), data, device="cpu", **settings)
    for _ in range(k):
        svi_step(state)
    save_svi_checkpoint(state, tmp_path / "ckpt")
    restored = svi_init(_model(), data, device="cpu", **settings)
    restore_svi_checkpoint(restored, tmp_path / "ckpt")
    assert restored.step == k and restored.elbo == reference.elbo[:k]
    assert restored.cursor == state.cursor and torch.equal(restored.order, state.order)
    for _ in range(SETTINGS["num_steps"] - k):
        svi_step(restored)
    assert restored.elbo == reference.elbo
    _assert_same_parameters(
        _states(restored.model, restored.guide), _states(reference.model, reference.guide)
    )


@pytest.mark.parametrize("shape", ["exponential", "cosine"])
def test_the_learning_rate_warms_up_linearly_then_decays_to_lr_times_lr_decay(data, shape):
    lr, steps, warmup, decay = 1e-2, 12, 4, 0.1
    state = svi_init(
        _model(), data, device="cpu", **SETTINGS | dict(lr_warmup=1 / 3, lr_schedule=shape)
    )
    rates = []
    for _ in range(steps):
        rates.append(state.optimizer.param_groups[0]["lr"])
        svi_step(state)
    assert rates[:warmup] == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr])
    assert rates[warmup] == pytest.approx(lr)  # the decay starts from lr
    after = state.optimizer.param_groups[0]["lr"]  # the rate a step past num_steps would use
    assert after == pytest.approx(lr * decay)
    u = 4 / 8  # halfway through the decay
    expected = decay**u if shape == "exponential" else decay + (1 - decay) / 2
    assert rates[warmup + 4] == pytest.approx(lr * expected)
    assert all(a >= b for a, b in zip(rates[warmup:-1], rates[warmup + 1 :], strict=True))


def test_a_checkpoint_saved_before_the_schedule_settings_resumes(data, tmp_path):
    """A checkpoint whose settings lack lr_warmup and lr_schedule was an exponential fit."""
    import json

    state = svi_init(_model(), data, device="cpu", **SETTINGS)
    svi_step(state)
    save_svi_checkpoint(state, tmp_path / "ckpt")
    meta_file = next((tmp_path / "ckpt").glob("*.json"))
    meta = json.loads(meta_file.read_text())
    for key in ("lr_warmup", "lr_schedule"):
        del meta["settings"][key]
    meta_file.write_text(json.dumps(meta))
    restored = svi_init(_model(), data, device="cpu", **SETTINGS)
    restore_svi_checkpoint(restored, tmp_path / "ckpt")
    assert restored.step == 1
    cosine = svi_init(_model(), data, device="cpu", **SETTINGS | WARMUP_COSINE)
    with pytest.raises(ValueError, match="its settings are"):
        restore_svi_checkpoint(cosine, tmp_path / "ckpt")


def test_restore_refuses_a_state_of_other_settings(data, tmp_path):
    state = svi_init(_model(), data, device="cpu", **SETTINGS)
    svi_step(state)
    save_svi_checkpoint(state, tmp_path / "ckpt")
    other = svi_init(_model(), data, device="cpu", **{**SETTINGS, "lr": 2e-2})
    with pytest.raises(ValueError, match="its settings are"):
        restore_svi_checkpoint(other, tmp_path / "ckpt")


@pytest.mark.filterwarnings("ignore:Encountered NaN")
def test_a_non_finite_step_rolls_back_to_the_last_finite_parameters(data):
    state = svi_init(_model(), data, device="cpu", init_scale=1.0, **{**SETTINGS, "lr": 1e4})
    with pytest.raises(NonFiniteELBOError) as info:
        for _ in range(50):
            svi_step(state)
    error = info.value
    assert error.step == state.step == len(state.elbo) and error.step >= 1
    for p, kept in zip(state.params, state.last_finite, strict=True):
        assert torch.isfinite(p).all() and torch.equal(p, kept)


def test_svi_init_checks_its_arguments(data):
    with pytest.raises(ValueError, match="guide must be one of"):
        svi_init(_model(), data, guide="laplace")
    with pytest.raises(
        TypeError, match=r"num_steps must be an int, got 3.0 of type float \(pass a Python int\)"
    ):
        svi_init(_model(), data, num_steps=3.0)
    with pytest.raises(ValueError, match=r"lr_decay must be in \(0, 1\] \(0 only with"):
        svi_init(_model(), data, lr_decay=0.0)
    with pytest.raises(ValueError, match=r"lr_decay must be in \[0, 1\], got 1.5"):
        svi_init(_model(), data, lr_decay=1.5, lr_schedule="cosine")
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        svi_init(_model(), data, lr_schedule="linear")
    with pytest.raises(ValueError, match=r"lr_warmup must be a fraction .* \[0, 1\), got 1"):
        svi_init(_model(), data, lr_warmup=1)
    with pytest.raises(TypeError, match="lr_warmup must be a number"):
        svi_init(_model(), data, lr_warmup="100")
    with pytest.raises(TypeError, match=r"svi_init\(\): got an unexpected keyword .*'progress'"):
        svi_init(_model(), data, progress=False)  # the loop's setting, fit_svi's only
