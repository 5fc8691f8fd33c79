"""probtransformer: Bayesian Transformers as Pyro models.

Transformer components with priors on projection weights and attention logits
(``probtransformer.layers``, ``.attention``, ``.block``, ``.encoder``), complete models
(``probtransformer.models``), and inference by SVI or MCMC returning one ``Posterior``
(``probtransformer.inference``).
"""

__version__ = "0.1.0"
