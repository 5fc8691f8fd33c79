"""MCMC: the fit_mcmc driver, the kernels, their adaptation, starts and MILE."""
