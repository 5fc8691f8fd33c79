"""Posterior and its draws: the prediction engine, results, save and load."""
