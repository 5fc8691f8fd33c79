"""The string form of ``fit_mcmc`` (``kernel="chees", init="ensemble", target_accept_prob=...``),
kept for one release with a ``DeprecationWarning``: it builds the settings objects that the
object form takes (``kernel=ChEES(...)``, ``starts=EnsembleStarts(...)``) and refuses a setting
the kernel would not read, as before."""

from __future__ import annotations

import warnings
from dataclasses import fields

from probtransformer.inference.mcmc.kernel import Kernel, ManyChainKernel
from probtransformer.inference.mcmc.registry import KERNELS, STARTS, kernel_class
from probtransformer.inference.mcmc.starts import Starts
from probtransformer.validation import check_int

#: The keyword arguments of the string form, each read by the kernels whose settings name it.
SETTINGS = (
    "target_accept_prob",
    "max_tree_depth",
    "step_size",
    "trajectory_length",
    "full_mass",
    "jit_compile",
    "compile",
    "temperature",
)

#: Values of the string form's arguments that meant "not set" for a kernel that does not read
#: them (their old defaults).
UNSET = dict(full_mass=False, jit_compile=False, temperature=1.0, max_tree_depth=10)


def from_strings(
    kernel: str, init: object = "prior", num_starts: object = None, **settings: object
) -> tuple[Kernel, Starts | None]:
    """``(kernel, starts)`` objects of the string form's arguments (``settings``: those given,
    None for unset), with a ``DeprecationWarning``.

    Raises:
        TypeError: an argument the string form never had.
        ValueError: an unknown kernel or start; a setting the kernel does not read (named,
            with the kernels that read it); starts for NUTS/HMC; MAP starts with
            ``num_starts != 1``.
    """
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"fit_mcmc() got unexpected keyword arguments {unknown}")
    cls = kernel_class(kernel)
    warnings.warn(
        f"fit_mcmc(kernel={kernel!r}, ...) is deprecated and will be removed in the next "
        f"release: pass kernel={cls.__name__}(...) and, for the many-chain kernels, "
        "starts=PriorStarts/MAPStarts/EnsembleStarts(...)",
        DeprecationWarning,
        stacklevel=3,
    )
    names = _field_names(cls)
    given = {
        k: v
        for k, v in settings.items()
        if v is not None and not (k not in names and k in UNSET and v == UNSET[k])
    }
    for name in sorted(given.keys() - names):
        readers = "/".join(f"'{n}'" for n, c in KERNELS.items() if name in _field_names(c))
        raise ValueError(f"{name} applies to kernel={readers}, not {kernel!r}: leave it unset")
    if num_starts is not None:
        check_int("num_starts", num_starts, type_error=True)
    if not issubclass(cls, ManyChainKernel):
        if init != "prior" or num_starts not in (None, 1):
            raise ValueError(
                f"init and num_starts apply to the many-chain kernels; kernel={kernel!r} starts "
                "each chain from a uniform draw in (-2, 2) of the unconstrained space (got "
                f"init={init!r}, num_starts={num_starts})"
            )
        return cls(**given), None
    if init not in STARTS:
        raise ValueError(f"init must be one of {tuple(STARTS)}, got {init!r}")
    start = STARTS[init]
    if "num_starts" not in _field_names(start):
        if num_starts not in (None, 1):
            raise ValueError(
                f"init={init!r} starts every chain from one MAP fit, so num_starts must be 1, "
                f"got {num_starts}; use init='ensemble' for {num_starts} MAP fits"
            )
        return cls(**given), start()
    return cls(**given), start(num_starts=num_starts)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


__all__ = ["SETTINGS", "from_strings"]
