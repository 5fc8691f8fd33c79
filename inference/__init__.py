"""Inference for Bayesian Transformers: fits that return one ``Posterior``."""

from probtransformer.inference.baselines import fit_ensemble, fit_map, fit_mc_dropout
from probtransformer.inference.checkpoint import restore_svi_checkpoint, save_svi_checkpoint
from probtransformer.inference.draws import Draws
from probtransformer.inference.loading import load_posterior
from probtransformer.inference.mcmc import fit_mcmc
from probtransformer.inference.mile import fit_mile
from probtransformer.inference.posterior import Posterior
from probtransformer.inference.prediction import (
    PosteriorAttention,
    Prediction,
    RegressionPrediction,
)
from probtransformer.inference.serialization import FORMAT_VERSION
from probtransformer.inference.svi import NonFiniteELBOError, SVIState, fit_svi, svi_init, svi_step

__all__ = [
    "Draws",
    "FORMAT_VERSION",
    "NonFiniteELBOError",
    "Posterior",
    "PosteriorAttention",
    "Prediction",
    "RegressionPrediction",
    "SVIState",
    "fit_ensemble",
    "fit_map",
    "fit_mc_dropout",
    "fit_mcmc",
    "fit_mile",
    "fit_svi",
    "load_posterior",
    "restore_svi_checkpoint",
    "save_svi_checkpoint",
    "svi_init",
    "svi_step",
]
