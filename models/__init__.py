"""Complete Bayesian Transformer models (Pyro models with likelihoods)."""

from probtransformer.models.classifier import SequenceClassifier

__all__ = ["SequenceClassifier"]
