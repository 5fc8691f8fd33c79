"""What every command of the CLI shares: its name, its error type and its output helpers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PROG = "probtransformer"


class CLIError(Exception):
    """A bad argument or input file found by the CLI itself (exit status 2)."""


def given(**kwargs: Any) -> dict[str, Any]:
    """The keyword arguments that were set; unset (None) ones keep the library defaults."""
    return {name: value for name, value in kwargs.items() if value is not None}


def warn(message: str) -> None:
    """Print ``probtransformer: warning: <message>`` (on one line) to stderr."""
    print(f"{PROG}: warning: {' '.join(message.split())}", file=sys.stderr)


def check_output(output: str | None, *, inputs: tuple[str, ...] = ()) -> None:
    """Refuse an ``--output`` that cannot be written, before the work that fills it.

    Raises:
        CLIError: ``output`` is empty, not a ``.csv``, a directory, in a directory that does
            not exist, or one of ``inputs`` (writing it would destroy the data read).
    """
    if output is None:
        return
    if not output.strip():
        raise CLIError("--output must name a file, got an empty string")
    path = Path(output)
    if path.is_dir():
        raise CLIError(f"cannot write --output {output}: it is a directory")
    if not path.parent.is_dir():
        raise CLIError(f"cannot write --output {output}: {path.parent} is not a directory")
    if path.suffix.lower() != ".csv":
        raise CLIError(f"--output is written as CSV: name a .csv file, got {output!r}")
    for given_ in inputs:
        if path.resolve() == Path(given_).resolve():
            raise CLIError(f"--output {output} is the input file: writing it would destroy it")


def write_csv(frame, output: str | None) -> None:
    """``frame`` (a pandas DataFrame) as CSV to ``output`` (--output), or to stdout.

    Raises:
        CLIError: ``output`` cannot be written.
    """
    if output is None:
        frame.to_csv(sys.stdout, index=False)
        return
    try:
        frame.to_csv(output, index=False)
    except OSError as e:
        raise CLIError(f"cannot write --output {output}: {e.strerror or e}") from e
