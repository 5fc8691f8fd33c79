"""Variational inference: SVI on Pyro's autoguides, its state, ELBO and checkpoints."""
