"""The settings checks of ``fit_mcmc``: which kernel reads which setting, where chains start,
and the process group that shards them."""

from __future__ import annotations

import math

from probtransformer.inference.distributed import DataParallel, data_parallel
from probtransformer.inference.mcmc.starts import INITS
from probtransformer.validation import check_int

#: Kernels accepted by ``fit_mcmc(kernel=...)``.
KERNELS = ("nuts", "hmc", "chees", "mclmc")

#: The kernels that run K chains together through the model's draw dim.
MANY_CHAIN_KERNELS = ("chees", "mclmc")

#: NUTS's doublings per transition at most, unless ``max_tree_depth`` says otherwise (Stan's
#: and Pyro's default).
DEFAULT_MAX_TREE_DEPTH = 10


def sharding(distributed: object, kernel: str, num_chains: int, device) -> DataParallel | None:
    """The process group the chains are sharded over (``distributed=True``), checked."""
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {distributed!r}")
    if not distributed:
        return None
    if kernel not in MANY_CHAIN_KERNELS:
        raise ValueError(
            f"distributed=True shards the chains of the many-chain kernels {MANY_CHAIN_KERNELS}; "
            f"kernel={kernel!r} runs Pyro's chains, as processes of one machine"
        )
    parallel = data_parallel(device)
    if num_chains < parallel.world_size:
        raise ValueError(
            f"num_chains must be at least the world size {parallel.world_size} (every rank "
            f"evaluates a share of the chains), got {num_chains}"
        )
    return parallel


#: The settings that some kernels only read, and those kernels (MCLMC is unadjusted and tunes
#: its own decoherence length; NUTS chooses its trajectories' lengths; NUTS and HMC trace
#: their potential with the PyTorch JIT, the many-chain kernels compile their K-chain density
#: and temper its likelihood).
#: The CLI's ``options.KERNEL_OPTIONS`` names the same, without torch.
KERNEL_SETTINGS = {
    "target_accept_prob": ("nuts", "hmc", "chees"),
    "max_tree_depth": ("nuts",),
    "trajectory_length": ("hmc", "chees"),
    "jit_compile": ("nuts", "hmc"),
    "compile": ("chees", "mclmc"),
    "full_mass": ("nuts", "hmc", "chees"),
    "temperature": ("chees", "mclmc"),
}


def check_kernel_settings(kernel: str, **given: bool) -> None:
    """Refuse a setting that ``kernel`` would not read (``given``: whether each was set)."""
    for name, is_set in given.items():
        if is_set and kernel not in KERNEL_SETTINGS[name]:
            kernels = "/".join(f"'{k}'" for k in KERNEL_SETTINGS[name])
            raise ValueError(f"{name} applies to kernel={kernels}, not {kernel!r}: leave it unset")


def check_starts(kernel: str, init: object, num_starts: object, num_chains: int) -> None:
    """``init`` and ``num_starts`` fit the kernel and ``num_chains``."""
    check_int("num_starts", num_starts, type_error=True)
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if kernel not in MANY_CHAIN_KERNELS:
        if init != "prior" or num_starts != 1:
            raise ValueError(
                f"init and num_starts apply to the many-chain kernels {MANY_CHAIN_KERNELS}; "
                f"kernel={kernel!r} starts each chain from a uniform draw in (-2, 2) of the "
                f"unconstrained space (got init={init!r}, num_starts={num_starts})"
            )
        return
    if num_chains % num_starts:
        raise ValueError(
            f"num_chains must be a multiple of num_starts (each start runs the same number of "
            f"chains), got num_chains={num_chains} and num_starts={num_starts}"
        )
    if init == "map" and num_starts != 1:
        raise ValueError(
            f"init='map' starts every chain from one MAP fit, so num_starts must be 1, got "
            f"{num_starts}; use init='ensemble' for {num_starts} MAP fits"
        )


def check_temperature(temperature: object) -> None:
    """``temperature`` is a finite number > 0.

    Raises:
        ValueError: anything else, named.
    """
    if isinstance(temperature, bool) or not (
        isinstance(temperature, (int, float)) and 0 < temperature < math.inf
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
