"""Is the main job's SVI fit converged, and what does its guide's spread come from? (issue 44)

    python -m benchmarks.studies.svi_convergence                          # the main job's fit
    python -m benchmarks.studies.svi_convergence --fit '{"init_scale": 0.1}'
    python -m benchmarks.studies.svi_convergence --estimator digits --fit '{"num_steps": 300}'

Fits ``SequenceClassifier(8, 10, 8)`` on ``load("digits").train`` (1,212 rows) with
``fit_svi``'s defaults overridden by the JSON options, on one torch thread, then prints one JSON
line: test accuracy, NLL (nats), ECE and mean epistemic uncertainty (100 draws), fit seconds,
the ELBO's move over the last tenth of the steps against its Monte Carlo noise (nats per
observation, ``guide_checks.elbo_change_per_obs`` / ``elbo_noise_per_obs``), the median guide sd
over the prior sd (``guide_checks.guide_scale_ratio``), the median guide sd of each site and the
PSIS k-hat of the guide (Yao et al. 2018; 100 draws, full training data).

``--estimator digits`` or ``breast-cancer`` fits ``BayesianTransformerClassifier`` instead
(``fit_options`` from ``--fit``, its own defaults otherwise): the README's example, scikit-learn's
digits / 16 as 8 steps of 8 pixels with ``d_model=16`` (rows :1200 to fit, 1200: to test), or
breast cancer standardised (rows :400 / 400:), and prints accuracy, NLL, mean epistemic
uncertainty and the guide sd ratio of the test rows.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from probtransformer.datasets import load
from probtransformer.inference import fit_svi
from probtransformer.inference.diagnostics._arviz import pareto_khat
from probtransformer.inference.diagnostics.guide_checks import (
    elbo_change_per_obs,
    elbo_noise_per_obs,
    guide_scale_ratio,
)
from probtransformer.metrics import classification_report
from probtransformer.models import SequenceClassifier


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", default="{}", help="fit_svi options (JSON)")
    parser.add_argument("--estimator", choices=("digits", "breast-cancer"), default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fit_options = json.loads(args.fit)
    if args.estimator is not None:
        return _estimator(args.estimator, fit_options)
    splits = load("digits")
    start = time.perf_counter()
    post = fit_svi(SequenceClassifier(8, 10, 8), splits.train, progress=False, **fit_options)
    seconds = time.perf_counter() - start
    pred = post.predict(splits.test.x, num_samples=100, seed=0)
    report = classification_report(pred.mean, splits.test.y)
    elbo, n = post.record["elbo"], post.record["num_data"]
    guide = post.guide
    sites = [name for name, _ in guide.prototype_trace.iter_stochastic_nodes()]
    weights = post.log_importance_weights(splits.train, num_samples=100, seed=0)
    row = dict(
        fit=fit_options,
        seconds=round(seconds, 1),
        **{key: round(value, 4) for key, value in report.items()},
        epistemic=round(pred.epistemic.mean().item(), 4),
        elbo_moved_per_obs=round(elbo_change_per_obs(elbo, n), 3),
        elbo_noise_per_obs=round(elbo_noise_per_obs(elbo, n), 4),
        scale_ratio=round(guide_scale_ratio(post), 3),
        site_scales={
            name: round(guide._get_loc_and_scale(name)[1].median().item(), 4) for name in sites
        },
        guide_k_hat=round(pareto_khat(weights), 1),
    )
    print(json.dumps(row))
    return row


def _estimator(name: str, fit_options: dict) -> dict:
    """One ``BayesianTransformerClassifier`` fit; prints and returns its row."""
    import numpy as np
    from sklearn.datasets import load_breast_cancer, load_digits
    from sklearn.preprocessing import StandardScaler

    from probtransformer.sklearn import BayesianTransformerClassifier

    if name == "digits":
        x, y = load_digits(return_X_y=True)
        x, sizes, cut = x / 16, dict(step_features=8, d_model=16), 1200
    else:
        x, y = load_breast_cancer(return_X_y=True)
        x, sizes, cut = StandardScaler().fit_transform(x), {}, 400
    steps = fit_options.pop("num_steps", 1000)
    clf = BayesianTransformerClassifier(
        num_steps=steps, random_state=0, fit_options=fit_options, **sizes
    )
    start = time.perf_counter()
    clf.fit(x[:cut], y[:cut])
    seconds = time.perf_counter() - start
    probs = clf.predict_proba(x[cut:])  # (N, C)
    nll = -np.log(probs[np.arange(len(probs)), y[cut:]]).mean()
    row = dict(
        estimator=name,
        num_steps=steps,
        fit=fit_options,
        seconds=round(seconds, 1),
        accuracy=round(clf.score(x[cut:], y[cut:]), 4),
        nll=round(float(nll), 4),
        epistemic=float(clf.predict_uncertainty(x[cut:]).epistemic.mean()),
        scale_ratio=round(guide_scale_ratio(clf.posterior_), 4),
    )
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
