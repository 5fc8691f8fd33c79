"""The scikit-learn estimators (``probtransformer.sklearn``): scikit-learn's own estimator checks,
and the estimators in ``Pipeline``, ``GridSearchCV`` and ``cross_val_score`` with answers known
in advance (an untrained candidate loses, accuracy above chance, labels round-trip)."""

import pickle
import warnings

import arviz as az
import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.datasets import load_digits
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import (
    check_classifiers_train,
    check_regressors_train,
    parametrize_with_checks,
)

from probtransformer.inference import Posterior
from probtransformer.inference.diagnostics.guide_checks import SCALE_RATIO_MIN, guide_scale_ratio
from probtransformer.sklearn import (
    EXPECTED_FAILED_CHECKS,
    INFERENCES,
    BayesianTransformerClassifier,
    BayesianTransformerRegressor,
)

#: Sizes and budget of scikit-learn's checks: each check fits several times, so 10 SVI steps.
TINY = dict(
    d_model=4, num_heads=1, num_layers=1, d_ff=8, num_steps=10, lr=0.1, num_samples=5,
    random_state=0,
)  # fmt: skip
#: A fit that learns the small problems below in about a second.
SMALL = dict(
    d_model=16, num_heads=2, num_layers=1, d_ff=32, num_steps=100, lr=0.02, num_samples=20,
    random_state=0,
)  # fmt: skip


def _expected_failures(estimator) -> dict[str, str]:
    """The module's EXPECTED_FAILED_CHECKS that apply to ``estimator``; the train checks get
    their budget in test_*_train_check_with_a_fit_budget."""
    other = "check_regressors_train" if hasattr(estimator, "predict_proba") else (
        "check_classifiers_train"
    )  # fmt: skip
    return {name: why for name, why in EXPECTED_FAILED_CHECKS.items() if name != other}


@parametrize_with_checks(
    [BayesianTransformerClassifier(**TINY), BayesianTransformerRegressor(**TINY)],
    expected_failed_checks=_expected_failures,
)
def test_sklearn_estimator_checks(estimator, check):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # inputs outside the training range
        check(estimator)


def test_classifier_train_check_with_a_fit_budget():
    """check_classifiers_train's accuracy bar (0.83 on blobs) with 60 steps of a small model
    (training accuracy 0.93 with these settings)."""
    small = {"d_model": 8, "d_ff": 16, "num_steps": 60, "lr": 0.03}
    estimator = BayesianTransformerClassifier(**{**TINY, **small})
    check_classifiers_train("BayesianTransformerClassifier", estimator)


@pytest.mark.slow
def test_regressor_train_check_with_a_fit_budget():
    """check_regressors_train's R^2 bar (0.5; one informative column of ten: attention must find
    its position) with 300 full-batch steps (about 10 s)."""
    estimator = BayesianTransformerRegressor(
        **{**TINY, "d_model": 8, "num_steps": 300, "lr": 0.02, "batch_size": 200}
    )
    check_regressors_train("BayesianTransformerRegressor", estimator)


# -- digits as sequences of 8 pixel rows ----------------------------------------------------


@pytest.fixture(scope="module")
def small_digits():
    """300 digits as (N, 8, 8) sequences in [0, 1]: 200 to fit, 100 held out."""
    digits = load_digits()
    x, y = (digits.images / 16.0)[:300], digits.target[:300]
    return x[:200], y[:200], x[200:], y[200:]


@pytest.fixture(scope="module")
def fitted(small_digits):
    x, y, _, _ = small_digits
    return BayesianTransformerClassifier(**SMALL).fit(x, y)


def test_a_short_svi_fit_keeps_epistemic_uncertainty(fitted, small_digits):
    """Issue 44: from fit_svi's init_scale 1e-3, 100 steps left every guide sd near 1e-3
    and the epistemic part about 1e-4 nats; the estimator starts its guide at 0.1."""
    _, _, x_test, _ = small_digits
    assert fitted.predict_uncertainty(x_test).epistemic.mean() > 0.01
    assert guide_scale_ratio(fitted.posterior_) > SCALE_RATIO_MIN
    assert fitted.posterior_.record["init_scale"] == 0.1
    verdict = fitted.posterior_.diagnose(num_samples=20, verbose=False).attrs["verdict"]
    assert any(line.startswith("ok    guide sd / prior sd") for line in verdict)


def test_classifier_learns_digits_and_splits_uncertainty(fitted, small_digits):
    _, _, x_test, y_test = small_digits
    assert fitted.score(x_test, y_test) > 0.5  # chance is 0.1
    assert fitted.n_features_in_ == 64 and fitted.input_shape_ == (8, 8)
    assert list(fitted.classes_) == list(range(10))
    assert isinstance(fitted.posterior_, Posterior)
    assert fitted.posterior_.record["method"] == "svi"
    assert fitted.posterior_.record["num_steps"] == SMALL["num_steps"]

    probs = fitted.predict_proba(x_test)
    assert probs.shape == (100, 10) and probs.dtype == np.float64
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-12)
    np.testing.assert_array_equal(fitted.predict(x_test), fitted.classes_[probs.argmax(1)])
    # the posterior predictive mean of the library, with the estimator's draws and seed
    pred = fitted.posterior_.predict(x_test, num_samples=SMALL["num_samples"], seed=0)
    np.testing.assert_allclose(probs, pred.mean.double().numpy(), atol=1e-6)

    frame = fitted.predict_uncertainty(x_test)
    assert list(frame.columns) == ["entropy", "aleatoric", "epistemic"] and len(frame) == 100
    np.testing.assert_allclose(frame.entropy, frame.aleatoric + frame.epistemic, atol=1e-5)
    assert (frame.epistemic >= 0).all() and frame.epistemic.mean() > 0  # SVI: draws differ
    distribution = fitted.predict_distribution(x_test)
    assert tuple(distribution.probs.shape) == (SMALL["num_samples"], 100, 10)


def test_same_seed_same_predictions_and_2d_input_is_the_flattened_sequence(fitted, small_digits):
    x, y, x_test, _ = small_digits
    again = clone(fitted).fit(x, y)
    np.testing.assert_array_equal(again.predict_proba(x_test), fitted.predict_proba(x_test))
    flat = x_test.reshape(len(x_test), -1)  # (N, T * F), step by step
    np.testing.assert_array_equal(fitted.predict_proba(flat), fitted.predict_proba(x_test))


@pytest.mark.filterwarnings("ignore:Estimated shape parameter of Pareto")  # a 100-step fit
def test_to_inference_data(fitted, small_digits):
    idata = fitted.to_inference_data(num_samples=10)
    assert {"posterior", "log_likelihood", "observed_data"} <= set(idata.groups())
    assert idata.log_likelihood["y"].sizes["obs"] == 200  # the training rows
    _, _, x_test, y_test = small_digits
    held_out = fitted.to_inference_data(x_test[:30], y_test[:30], num_samples=10)
    assert held_out.log_likelihood["y"].sizes["obs"] == 30
    assert np.isfinite(az.loo(held_out).elpd_loo)
    with pytest.raises(ValueError, match="give both X and y"):
        fitted.to_inference_data(x_test)


def test_pickle_keeps_the_posterior(fitted, small_digits):
    _, _, x_test, _ = small_digits
    copy = pickle.loads(pickle.dumps(fitted))
    assert isinstance(copy.posterior_, Posterior)
    assert isinstance(fitted.posterior_, Posterior)  # pickling left the original as it was
    np.testing.assert_array_equal(copy.predict_proba(x_test), fitted.predict_proba(x_test))


# pixels that are constant in the 200 training rows scale held-out rows far outside their range
@pytest.mark.filterwarnings("ignore:x spans:UserWarning")
def test_pipeline_scales_flattened_digits(small_digits):
    x, y, x_test, y_test = small_digits
    flat, flat_test = x.reshape(200, 64), x_test.reshape(100, 64)
    pipe = make_pipeline(StandardScaler(), BayesianTransformerClassifier(step_features=8, **SMALL))
    pipe.fit(flat, y)
    assert pipe[-1].input_shape_ == (8, 8)
    assert pipe.score(flat_test, y_test) > 0.5


def test_grid_search_picks_the_trained_candidate_and_refits():
    """Two well-separated classes; the 1-step candidates are untrained: the search must pick
    num_steps=60 (a known answer), whatever d_model, and refit the winner on all rows."""
    rng = np.random.default_rng(0)
    y = np.repeat([0, 1], 40)
    x = rng.normal(size=(80, 4, 2)) + 1.5 * (2 * y - 1)[:, None, None]
    estimator = BayesianTransformerClassifier(**{**TINY, "lr": 0.05})
    grid = {"d_model": [4, 8], "num_steps": [1, 60]}
    search = GridSearchCV(estimator, grid, cv=2, n_jobs=1).fit(x, y)
    assert search.best_params_["num_steps"] == 60
    assert search.best_score_ > 0.9
    best = search.best_estimator_
    assert best.d_model == search.best_params_["d_model"] and best.num_steps == 60
    assert best.posterior_.record["num_data"] == 80  # refitted on every row
    assert len(search.cv_results_["params"]) == 4
    assert estimator.get_params()["num_steps"] == TINY["num_steps"]  # the template untouched


def test_cross_val_score_above_chance(small_digits):
    x, y, _, _ = small_digits
    scores = cross_val_score(BayesianTransformerClassifier(**SMALL), x, y, cv=3, n_jobs=1)
    assert scores.shape == (3,) and scores.mean() > 0.4  # chance is 0.1


def test_string_labels_round_trip():
    rng = np.random.default_rng(2)
    labels = np.array(["dog", "cat", "emu"])
    y = labels[rng.integers(0, 3, size=60)]
    x = rng.normal(size=(60, 3, 2))
    clf = BayesianTransformerClassifier(**TINY).fit(x, y)
    assert list(clf.classes_) == ["cat", "dog", "emu"]
    predicted = clf.predict(x)
    assert predicted.dtype == y.dtype and set(predicted) <= set(labels)
    assert 0.0 <= clf.score(x, y) <= 1.0
    idata = clf.to_inference_data(x[:5], y[:5], num_samples=5)
    assert idata.observed_data["y"].values.tolist() == [
        list(clf.classes_).index(label) for label in y[:5]
    ]
    with pytest.raises(ValueError, match="labels not seen in fit"):
        clf.to_inference_data(x[:2], np.array(["cat", "yak"]))


def test_clone_and_params():
    options = {"bayesian": ("attention",)}
    clf = BayesianTransformerClassifier(inference="map", model_options=options, d_model=8)
    copy = clone(clf)
    assert copy.get_params() == clf.get_params()
    assert copy.model_options is not options and copy.model_options == options
    assert copy.get_params()["inference"] == "map"
    copy.set_params(d_model=16, inference="ensemble")
    assert (copy.d_model, copy.inference, clf.d_model) == (16, "ensemble", 8)
    regressor = BayesianTransformerRegressor(likelihood="student_t")
    assert clone(regressor).likelihood == "student_t"
    assert "likelihood" in regressor.get_params() and "likelihood" not in clf.get_params()


# -- errors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_fit():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(20, 4, 2)), np.arange(20) % 2
    return BayesianTransformerClassifier(**TINY).fit(x, y), x, y


def test_wrong_feature_count_names_expected_and_got(tiny_fit):
    clf, x, _ = tiny_fit
    with pytest.raises(ValueError, match="X has 5 features, but BayesianTransformerClassifier is "
                       "expecting 8 features as input"):  # fmt: skip
        clf.predict(np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"shape \(T, F\)=\(4, 3\), but .* expecting \(4, 2\)"):
        clf.predict_proba(np.zeros((3, 4, 3)))
    with pytest.raises(ValueError, match="3-D .* or 2-D"):
        clf.predict(np.zeros((3, 4, 2, 1)))


def test_bad_inference_names_the_choices():
    x, y = np.zeros((10, 3, 1)), np.arange(10) % 2
    for estimator in (BayesianTransformerClassifier, BayesianTransformerRegressor):
        with pytest.raises(ValueError, match=r"inference must be one of \('svi', 'map'") as error:
            estimator(inference="foo").fit(x, y)
        assert all(name in str(error.value) for name in INFERENCES) and "'foo'" in str(error.value)


def test_bad_inputs_at_fit():
    x, y = np.random.default_rng(0).normal(size=(10, 3, 2)), np.arange(10) % 2
    clf = BayesianTransformerClassifier(**TINY)
    with pytest.raises(ValueError, match="NaN"):
        clf.fit(np.where(np.eye(3)[None, :, :2] == 1, np.nan, x), y)
    with pytest.raises(ValueError, match="only one class"):
        clf.fit(x, np.zeros(10))
    with pytest.raises(ValueError, match="Unknown label type"):
        clf.fit(x, np.linspace(0, 1, 10))
    with pytest.raises(ValueError, match="3-D .* or 2-D"):
        clf.fit(x[..., None], y)
    with pytest.raises(ValueError, match="not a whole number of steps of step_features=4"):
        BayesianTransformerClassifier(step_features=4).fit(x.reshape(10, 6), y)
    with pytest.raises(ValueError, match="d_model"):  # the model's own message
        BayesianTransformerClassifier(d_model=6, num_heads=4).fit(x, y)
    with pytest.raises(NotFittedError):
        BayesianTransformerClassifier().predict_uncertainty(x)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"num_samples must be None .* got {bad!r}"):
            BayesianTransformerClassifier(num_samples=bad).fit(x, y)


def test_renamed_dataframe_columns_are_refused_at_predict():
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(20, 6)), columns=[f"t{i}" for i in range(6)])
    clf = BayesianTransformerClassifier(**TINY).fit(frame, np.arange(20) % 2)
    with pytest.raises(ValueError, match="Feature names unseen at fit time:\n- u0"):
        clf.predict(frame.rename(columns={"t0": "u0"}))
    assert clf.predict(frame).shape == (20,)


# -- the other inference methods and the regressor ------------------------------------------


@pytest.mark.parametrize("inference", ["map", "mc-dropout", "ensemble"])
def test_map_based_inference(inference, tiny_fit):
    _, x, y = tiny_fit
    clf = BayesianTransformerClassifier(inference=inference, n_members=3, **TINY).fit(x, y)
    assert clf.posterior_.record["method"] == inference
    frame = clf.predict_uncertainty(x)
    if inference == "map":  # one point estimate: nothing epistemic
        assert (frame.epistemic == 0).all()
    else:
        assert frame.epistemic.mean() > 0
    draws = clf.predict_distribution(x).probs.shape[0]
    assert draws == {"map": 1, "mc-dropout": TINY["num_samples"], "ensemble": 3}[inference]


@pytest.mark.parametrize(
    "inference, settings",
    [
        ("laplace", {}),
        ("mola", dict(n_members=2, hessian="diag", prior_precision=1.0, predictive="nn")),
    ],
)
def test_laplace_inference(inference, settings, tiny_fit):
    """The Laplace approximation around a MAP fit (``fit_laplace``) or every member of a deep
    ensemble (``fit_mola``): its settings reach the fit, which keeps ``num_samples`` draws."""
    _, x, y = tiny_fit
    clf = BayesianTransformerClassifier(inference=inference, **settings, **TINY).fit(x, y)
    record = clf.posterior_.record
    assert record["method"] == inference
    expected = dict(hessian="full", prior_precision="marglik", predictive="glm") | {
        key: value for key, value in settings.items() if key != "n_members"
    }
    assert {key: record[key] for key in expected} == expected
    assert record["subset"] == ["head.weight", "head.bias"]  # laplace_subset="head"
    assert len(record["laplace"]) == settings.get("n_members", 1)
    members = settings.get("n_members", 1)
    assert clf.posterior_.samples["head.weight"].shape[:2] == (
        members, -(-TINY["num_samples"] // members),
    )  # fmt: skip
    proba = clf.predict_proba(x)
    assert proba.shape == (20, 2) and np.allclose(proba.sum(1), 1)
    assert clf.predict_uncertainty(x).epistemic.mean() > 0
    assert set(clf.predict(x)) <= {0, 1}


def test_laplace_settings_are_refused_by_fit_laplace(tiny_fit):
    _, x, y = tiny_fit
    clf = BayesianTransformerClassifier(inference="laplace", hessian="kfac", **TINY)
    with pytest.raises(ValueError, match=r"hessian must be one of \('full', 'kron', 'diag'\), got"):
        clf.fit(x, y)
    reg = BayesianTransformerRegressor(inference="laplace", laplace_subset="ffn", **TINY)
    with pytest.raises(ValueError, match=r"subset must be one of \('head', 'attention', 'all'\)"):
        reg.fit(x, y.astype(float))


def test_fit_options_reach_the_fit(tiny_fit):
    _, x, y = tiny_fit
    clf = BayesianTransformerClassifier(fit_options={"guide": "lowrank"}, **TINY).fit(x, y)
    assert clf.posterior_.record["guide"] == "lowrank"


@pytest.mark.filterwarnings("ignore:num_warmup=10 is short")
def test_mcmc_inference(tiny_fit):
    """ChEES-HMC, 2 chains of 10 + 5 transitions from prior draws (about 1 s)."""
    _, x, y = tiny_fit
    clf = BayesianTransformerClassifier(
        inference="mcmc", num_chains=2, num_warmup=10, num_draws=5,
        fit_options={"num_starts": 1, "init": "prior"}, **{**TINY, "num_samples": None},
    ).fit(x, y)  # fmt: skip
    assert clf.posterior_.record["method"] == "mcmc"
    assert clf.posterior_.record["kernel"] == "chees"
    assert clf.predict_distribution(x).probs.shape[0] == 10  # every draw: 2 chains x 5
    assert "sample_stats" in clf.to_inference_data().groups()


def test_regressor_learns_and_gives_intervals():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(200, 5, 2))
    y = 3.0 * x.sum((1, 2)) + 10.0 + 0.5 * rng.normal(size=200)  # far from unit scale
    reg = BayesianTransformerRegressor(**SMALL).fit(x[:150], y[:150])
    assert reg.score(x[150:], y[150:]) > 0.8
    mean, std = reg.predict(x[150:], return_std=True)
    assert mean.shape == std.shape == (50,) and mean.dtype == np.float64 and (std > 0).all()
    np.testing.assert_array_equal(mean, reg.predict(x[150:]))
    lower, upper = reg.predict_interval(x[150:], prob=0.9)
    assert (lower < upper).all() and 0.7 <= ((lower <= y[150:]) & (y[150:] <= upper)).mean()
    frame = reg.predict_uncertainty(x[150:])
    assert isinstance(frame, pd.DataFrame)
    assert {"mean", "std", "aleatoric", "epistemic", "lower", "upper"} <= set(frame.columns)
    with pytest.raises(ValueError, match="prob must be in"):
        reg.predict_interval(x[:2], prob=1.5)


def test_regressor_multi_output():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(40, 3, 1))
    y = np.stack([x.sum((1, 2)), -x.sum((1, 2))], axis=1)
    reg = BayesianTransformerRegressor(**TINY).fit(x, y)
    assert reg.posterior_.model.horizon == 2
    assert reg.predict(x).shape == (40, 2)
    lower, upper = reg.predict_interval(x)
    assert lower.shape == upper.shape == (40, 2)
