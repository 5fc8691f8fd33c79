"""The inference methods by name: the one table from which the command line (``--inference``),
the scikit-learn wrappers (``inference=``) and their help read the choices. Names only, so
that reading it imports no torch (the CLI's ``--help``); ``tests/architecture`` checks that
every function it names is public in ``probtransformer.inference``. The MCMC kernels and
start strategies have their own table, ``inference.mcmc.registry``.
"""

#: ``{name: fit function of probtransformer.inference}``, in the order the CLI lists them.
METHODS: dict[str, str] = {
    "svi": "fit_svi",
    "map": "fit_map",
    "mcmc": "fit_mcmc",
    "mile": "fit_mile",
    "mc-dropout": "fit_mc_dropout",
    "ensemble": "fit_ensemble",
}

#: The methods that are MAP fits (``fit_svi`` with a point-mass guide) of one or more members.
MAP_BASED = ("map", "mc-dropout", "ensemble")

__all__ = ["MAP_BASED", "METHODS"]
