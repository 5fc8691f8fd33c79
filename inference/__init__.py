"""Inference for Bayesian Transformers: fits that return one ``Posterior``."""

from probtransformer.inference.baselines import fit_ensemble, fit_map, fit_mc_dropout
from probtransformer.inference.mcmc import fit_mcmc
from probtransformer.inference.posterior import Posterior
from probtransformer.inference.prediction import (
    PosteriorAttention,
    Prediction,
    RegressionPrediction,
)
from probtransformer.inference.serialization import FORMAT_VERSION, load_posterior
from probtransformer.inference.svi import NonFiniteELBOError, fit_svi

__all__ = [
    "FORMAT_VERSION",
    "NonFiniteELBOError",
    "Posterior",
    "PosteriorAttention",
    "Prediction",
    "RegressionPrediction",
    "fit_ensemble",
    "fit_map",
    "fit_mc_dropout",
    "fit_mcmc",
    "fit_svi",
    "load_posterior",
]
