"""Complete Bayesian Transformer models (Pyro models with likelihoods)."""

from probtransformer.models.classifier import SequenceClassifier
from probtransformer.models.forecast import forecast
from probtransformer.models.generate import Generation, generate
from probtransformer.models.linear import BayesianLinearRegression
from probtransformer.models.regression import Seq2Seq, SequenceRegressor
from probtransformer.models.token import CausalLM, TokenTagger

__all__ = [
    "BayesianLinearRegression",
    "CausalLM",
    "Generation",
    "Seq2Seq",
    "SequenceClassifier",
    "SequenceRegressor",
    "TokenTagger",
    "forecast",
    "generate",
]
