# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Quickstart: a Bayesian Transformer on handwritten digits
#
# This notebook walks through the whole probtransformer workflow on a small, real data set:
#
# 1. load the data as sequences,
# 2. build a `SequenceClassifier` whose attention projections and output head are random
#    variables,
# 3. fit it by stochastic variational inference (SVI),
# 4. predict with uncertainty and check calibration,
# 5. look at the posterior distribution of the attention weights,
# 6. export to ArviZ for summaries, PSIS-LOO and convergence diagnostics.
#
# Run with the environment variable `PROBTRANSFORMER_SMOKE=1` to use tiny sizes (a few seconds,
# as the test suite does); without it the notebook uses the library defaults (about two to three
# minutes of fitting on two CPU cores).

# %%
# %matplotlib inline
import os

import arviz as az
import pandas as pd
import torch
from matplotlib.figure import Figure

from probtransformer import metrics, plots
from probtransformer.datasets import load
from probtransformer.inference import fit_svi
from probtransformer.models import SequenceClassifier

SMOKE = os.environ.get("PROBTRANSFORMER_SMOKE") == "1"
pd.set_option("display.max_columns", None, "display.width", 200)  # print every column

# %% [markdown]
# ## 1. Data: each 8x8 digit image is a sequence of 8 rows
#
# `load("digits")` returns train, validation and test splits of scikit-learn's 1,797
# handwritten digits. Each image is read top to bottom as a sequence of `T = 8` steps with
# `F = 8` pixel features per step, so a Transformer attends between image rows. The splits are
# `SequenceData` objects holding CPU tensors `x (N, T, F)`, `y (N,)` and an optional padding
# mask (all rows are complete here, so it is `None`).

# %%
splits = load("digits", seed=0)
train, test = splits.train, splits.test
if SMOKE:
    train = train[:200]
N, T, F = train.x.shape
num_classes = splits.meta["num_classes"]
print(f"train {tuple(train.x.shape)}, test {tuple(test.x.shape)}, {num_classes} classes")
assert train.y.shape == (N,)

# %% [markdown]
# ## 2. The model
#
# `SequenceClassifier` embeds each step, adds sinusoidal positions, runs Transformer blocks,
# mean-pools over steps and maps to class logits; `y ~ Categorical(logits)`. With the default
# `bayesian=("attention", "head")` the Q/K/V/O projections of every attention layer, a per-head
# attention inverse temperature (`logit_scale`) and the output head are latent variables with
# priors; the embedding, feed-forward and LayerNorm weights are point estimates. Making only
# these parts Bayesian keeps SVI accurate: mean-field VI over *every* weight under-fits badly.

# %%
sizes = dict(d_model=16, num_heads=2, num_layers=1, d_ff=32) if SMOKE else {}
model = SequenceClassifier(F, num_classes, T, **sizes)
print(model.config)

# %% [markdown]
# ## 3. Fit by SVI
#
# `fit_svi` maximises the evidence lower bound (ELBO) with a mean-field normal guide on
# mini-batches, showing a progress bar with the running ELBO. It works on a copy of the model,
# so `model` itself is left untouched, and returns a `Posterior`: the one object used for
# everything that follows. The ELBO per step is kept in `post.record["elbo"]`; it should rise
# and level off. `post.latent_shapes` lists the latent variables the guide approximates.

# %%
fit_options = dict(num_steps=30, batch_size=64) if SMOKE else {}
post = fit_svi(model, train, seed=0, **fit_options)
elbo = post.record["elbo"]
print(f"{len(elbo)} steps in {post.record['seconds']:.1f} s, final ELBO {elbo[-1]:.1f} nats")
print({name: tuple(shape) for name, shape in post.latent_shapes.items()})


# %%
def trace_figure(values: list[float]) -> Figure:
    """Line plot of the ELBO per step."""
    fig = Figure(figsize=(6, 3), layout="constrained")
    ax = fig.subplots()
    ax.plot(values)
    ax.set(xlabel="step", ylabel="ELBO (nats)", title="SVI trace")
    return fig


trace_figure(elbo)

# %% [markdown]
# ## 4. Predict with uncertainty
#
# `post.predict` draws weights from the posterior and returns the class probabilities of every
# draw, `probs (S, N, C)`. Averaging over draws gives the posterior predictive. Accuracy says
# how often the top class is right; the negative log-likelihood (NLL, nats) and the expected
# calibration error (ECE) say whether the probabilities can be trusted: a calibrated model that
# says 90 % is right about 90 % of the time.

# %%
num_samples = 10 if SMOKE else 100
pred = post.predict(test.x, test.mask, num_samples=num_samples, seed=0)
assert pred.probs.shape == (num_samples, len(test), num_classes)
report = metrics.classification_report(pred.mean, test.y)
print({name: round(value, 4) for name, value in report.items()})

# %%
plots.reliability_figure(pred.mean, test.y, title="test split")

# %% [markdown]
# The predictive entropy of each example (nats) splits into two parts:
#
# - **aleatoric**: the expected entropy of a single draw's prediction: ambiguity in the input
#   itself (a sloppy 1 that looks like a 7) that more data would not remove;
# - **epistemic**: the mutual information between the label and the weights: disagreement
#   between posterior draws, which more data would reduce. High epistemic uncertainty flags
#   inputs unlike the training data.
#
# The most uncertain test digits are the ones to send to a human.

# %%
table = pred.to_dataframe(class_names=splits.meta["class_names"])
table["label"] = [str(c) for c in test.y.tolist()]
table["correct"] = table["predicted"] == table["label"]
columns = ["label", "predicted", "correct", "entropy", "aleatoric", "epistemic"]
uncertain = table.sort_values("entropy", ascending=False)[columns].head(8)
print(uncertain.round(3))


# %%
def digits_figure(images: torch.Tensor, titles: list[str]) -> Figure:
    """One panel per ``(8, 8)`` image of ``images (n, 8, 8)``, each with its title."""
    fig = Figure(figsize=(1.1 * len(images), 1.6), layout="constrained")
    axes = fig.subplots(1, len(images), squeeze=False)[0]
    for ax, image, title in zip(axes, images, titles, strict=True):
        ax.imshow(image.numpy(), cmap="gray_r")
        ax.set_title(title, fontsize=8)
        ax.set_axis_off()
    return fig


titles = [f"{r.label} -> {r.predicted}\nH = {r.entropy:.2f}" for r in uncertain.itertuples()]
digits_figure(test.x[uncertain.index.tolist()], titles)

# %% [markdown]
# ## 5. Posterior attention
#
# Attention weights are a probability distribution over keys (image rows) for each query row.
# With latent projections they become random: `post.attention` returns their posterior
# samples `(chain, draw, n, layer, head, query, key)`. The plot shows, for one test digit, the
# posterior mean of every layer and head next to its posterior standard deviation: bright
# cells on the right are attention weights the data did not pin down.

# %%
att = post.attention(test.x[:4], num_samples=num_samples, seed=0)
print("attention samples", tuple(att.samples.shape))
assert torch.allclose(att.mean().sum(-1), torch.ones(()), atol=1e-4)  # rows are distributions
att.plot(0)

# %% [markdown]
# ## 6. ArviZ: summaries, LOO and diagnostics
#
# `to_inference_data` exports the posterior draws, the pointwise log-likelihood of the training
# data, posterior-predictive replicates, the test predictions and the posterior attention of a
# few training sequences as an ArviZ `InferenceData`, with a named dimension on every axis.

# %%
idata = post.to_inference_data(train, test=test, num_samples=num_samples, seed=0)
print(idata.groups())

# %% [markdown]
# `az.summary` gives posterior means, standard deviations and highest-density intervals. The
# logit scales are per-head inverse temperatures: a value above 1 means the head sharpens its
# attention beyond plain scaled dot-product attention, below 1 that it spreads it out. For the
# attention itself, select a few entries with `coords`: summarising all of them is slow and
# unreadable. (For SVI the R-hat and ESS columns are not meaningful: the draws are independent
# samples from the fitted guide, not a Markov chain.)

# %%
logit_scales = [name for name in idata.posterior.data_vars if name.endswith("logit_scale")]
print(az.summary(idata, var_names=logit_scales, kind="stats"))

# %%
first_query = {"attention_obs": [0], "layer": [0], "head": [0], "query": [0]}
print(az.summary(idata, var_names=["attention"], coords=first_query, kind="stats"))

# %% [markdown]
# PSIS-LOO estimates the expected log predictive density on new data from the training fit
# alone (Vehtari, Gelman & Gabry 2017). Pareto k values above 0.7 mark training examples whose
# removal would change the posterior too much for the importance-sampling estimate to be
# reliable. With tens of thousands of latent weights many examples can exceed it (about a third
# in a full run of this notebook); the test-split NLL above is then the better guide to
# predictive quality.

# %%
print(az.loo(idata))

# %% [markdown]
# `post.diagnose` collects the checks in one table with one row per latent variable group (not
# thousands of rows), returns it and prints a verdict: whether the ELBO has levelled off, and
# the LOO figures with their Pareto-k counts. For MCMC fits it adds R-hat and ESS per group. A
# `WARN` line says what to look at: an ELBO still changing means the guide has not converged
# (for the digits defaults that is deliberate, see `benchmarks/BENCHMARKS.md`), many high
# Pareto k values call for caution with LOO.

# %%
print(post.diagnose(train, num_samples=num_samples))
