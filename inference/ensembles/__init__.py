"""Point estimates and ensembles: MAP, MC dropout, deep ensembles (batched)."""
