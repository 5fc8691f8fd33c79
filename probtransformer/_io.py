"""Atomic replacement of output directories, shared by ``Posterior.save`` and the CLI."""

from __future__ import annotations

import json
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


def read_versioned_json(path: Path, latest: int, what: str = "format_version") -> dict:
    """The JSON object in ``path``, refused when damaged or written by a newer version.

    Raises:
        ValueError: not JSON, no integer ``format_version``, or one above ``latest`` (the message
            says to upgrade; ``what`` names the format in it).
    """
    try:
        meta = json.loads(path.read_text())
        version = meta["format_version"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is damaged: {(str(e).splitlines() or [repr(e)])[0]}") from e
    if not isinstance(version, int) or version > latest:
        raise ValueError(
            f"{path.parent} has {what} {version!r}; this probtransformer reads versions "
            f"<= {latest}: upgrade probtransformer"
        )
    return meta
