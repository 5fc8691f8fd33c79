"""The kernels and start strategies by name: the one table that the string form of
``fit_mcmc``, the CLI (``--kernel``, ``--init``; through its generated defaults), the
scikit-learn wrappers and ``diagnose`` read. A new kernel is one file and one entry here.
"""

from __future__ import annotations

from probtransformer.inference.mcmc.adjusted_mclmc import AdjustedMCLMC
from probtransformer.inference.mcmc.chees import ChEES
from probtransformer.inference.mcmc.hmc import HMC, NUTS
from probtransformer.inference.mcmc.kernel import Kernel, ManyChainKernel
from probtransformer.inference.mcmc.mclmc import MCLMC
from probtransformer.inference.mcmc.starts import EnsembleStarts, MAPStarts, PriorStarts, Starts

#: ``{name: settings class}`` of every kernel, in the order the CLI lists them.
KERNELS: dict[str, type[Kernel]] = {
    cls.name: cls for cls in (NUTS, HMC, ChEES, MCLMC, AdjustedMCLMC)
}

#: The kernels that run K chains together through the model's draw dim.
MANY_CHAIN_KERNELS = tuple(n for n, cls in KERNELS.items() if issubclass(cls, ManyChainKernel))

#: ``{name: start strategy}`` of the many-chain kernels.
STARTS: dict[str, type[Starts]] = {
    cls.name: cls for cls in (PriorStarts, MAPStarts, EnsembleStarts)
}


def kernel_class(name: object) -> type[Kernel]:
    """The settings class of the kernel ``name``.

    Raises:
        ValueError: an unknown name, with the known ones.
    """
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {name!r}")
    return KERNELS[name]


__all__ = ["KERNELS", "MANY_CHAIN_KERNELS", "STARTS", "kernel_class"]
