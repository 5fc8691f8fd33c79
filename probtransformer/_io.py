"""Atomic replacement of output directories, shared by ``Posterior.save`` and the CLI."""

from __future__ import annotations

import shutil
from pathlib import Path


def replace_directory(staging: Path, target: Path) -> None:
    """Move the finished ``staging`` directory to ``target``.

    An existing ``target`` is moved aside first and deleted only after the new one is in place,
    so a failure leaves either the old or the new directory, never a mix or nothing.
    """
    if not target.exists():
        staging.rename(target)
        return
    old = staging.with_name(staging.name + ".old")
    target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old)
