"""Atomic replacement of output directories, shared by ``Posterior.save``, checkpoints and the
CLI's run directories."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike) -> Iterator[Path]:
    """A new, empty staging directory next to ``target`` for the block to fill.

    When the block ends normally the staging directory replaces ``target``
    (``replace_directory``); whatever ends it otherwise (an error, Ctrl-C) it is removed and
    ``target`` is left as it was. The staging directory gets the usual (umask) permissions.

    Raises:
        OSError: ``target``'s parent or the staging directory cannot be created, or the move
            fails.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp makes 0700
        yield staging
        replace_directory(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def read_versioned_json(path: Path, latest: int, what: str = "format_version") -> dict:
    """The JSON object in ``path``, refused when damaged or written by a newer version.

    Raises:
        ValueError: not JSON, no integer ``format_version``, or one above ``latest`` (the message
            says to upgrade; ``what`` names the format in it).
    """
    try:
        meta = json.loads(path.read_text())
        version = meta["format_version"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"{path} is damaged: {(str(e).splitlines() or [repr(e)])[0]}") from e
    if not isinstance(version, int) or version > latest:
        raise ValueError(
            f"{path.parent} has {what} {version!r}; this probtransformer reads versions "
            f"<= {latest}: upgrade probtransformer"
        )
    return meta
