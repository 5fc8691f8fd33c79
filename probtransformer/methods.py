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
    "laplace": "fit_laplace",
    "mola": "fit_mola",
}

#: The methods that are MAP fits (``fit_svi`` with a point-mass guide) of one or more members.
MAP_BASED = ("map", "mc-dropout", "ensemble")

#: The Laplace approximations (``inference.laplace``): a Gaussian around each mode of a MAP fit
#: (``laplace``) or of every member of a deep ensemble (``mola``), which they fit first. Not
#: in ``MAP_BASED``: their posterior is no MAP fit, and they take settings of their own
#: (``subset``, ``hessian``, ``prior_precision``, ``predictive``) besides ``fit_map``'s
#: (``mola``: ``fit_ensemble``'s, ``n_members`` included).
LAPLACE_BASED = ("laplace", "mola")

__all__ = ["LAPLACE_BASED", "MAP_BASED", "METHODS"]
