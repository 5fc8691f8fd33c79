"""Inference for Bayesian Transformers: fits that return one ``Posterior``."""

from probtransformer.inference.ensembles.baselines import fit_ensemble, fit_map, fit_mc_dropout
from probtransformer.inference.laplace.fit import fit_laplace, fit_mola
from probtransformer.inference.mcmc.adjusted_mclmc import AdjustedMCLMC
from probtransformer.inference.mcmc.chees import ChEES
from probtransformer.inference.mcmc.driver import fit_mcmc
from probtransformer.inference.mcmc.hmc import HMC, NUTS
from probtransformer.inference.mcmc.mclmc import BLACKJAX_TUNING, MCLMC, MILE_TUNING, Tuning
from probtransformer.inference.mcmc.mile import fit_mile
from probtransformer.inference.mcmc.starts import EnsembleStarts, MAPStarts, PriorStarts
from probtransformer.inference.posterior.draws import Draws
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.inference.posterior.results import (
    PosteriorAttention,
    Prediction,
    RegressionPrediction,
)
from probtransformer.inference.posterior.saving import FORMAT_VERSION, load_posterior
from probtransformer.inference.vi.checkpoint import restore_svi_checkpoint, save_svi_checkpoint
from probtransformer.inference.vi.svi import (
    NonFiniteELBOError,
    SVIState,
    fit_svi,
    svi_init,
    svi_step,
)

__all__ = [
    "AdjustedMCLMC",
    "BLACKJAX_TUNING",
    "HMC",
    "MCLMC",
    "MILE_TUNING",
    "NUTS",
    "ChEES",
    "Draws",
    "EnsembleStarts",
    "FORMAT_VERSION",
    "MAPStarts",
    "NonFiniteELBOError",
    "Posterior",
    "PosteriorAttention",
    "PriorStarts",
    "Prediction",
    "RegressionPrediction",
    "SVIState",
    "Tuning",
    "fit_ensemble",
    "fit_laplace",
    "fit_map",
    "fit_mc_dropout",
    "fit_mcmc",
    "fit_mile",
    "fit_mola",
    "fit_svi",
    "load_posterior",
    "restore_svi_checkpoint",
    "save_svi_checkpoint",
    "svi_init",
    "svi_step",
]
