"""Complete Bayesian Transformer models (Pyro models with likelihoods)."""

from probtransformer.models.classifier import SequenceClassifier
from probtransformer.models.linear import BayesianLinearRegression

__all__ = ["BayesianLinearRegression", "SequenceClassifier"]
