"""Complete Bayesian Transformer models (Pyro models with likelihoods).

A saved posterior is rebuilt only from a registered model class: the built-in models here, and
your own classes decorated with ``register_model`` (or installed under the entry-point group
``probtransformer.models``), so loading never imports what a file names
(``probtransformer.models.registry``).
"""

from probtransformer.models.classifier import SequenceClassifier
from probtransformer.models.forecast import forecast
from probtransformer.models.generate import Generation, TokenStep, generate, generate_stream
from probtransformer.models.linear import BayesianLinearRegression
from probtransformer.models.registry import register_model
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
    "generate_stream",
    "TokenStep",
    "register_model",
]
