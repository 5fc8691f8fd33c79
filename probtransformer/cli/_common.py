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


def check_output(output: str | None) -> None:
    """Refuse an ``--output`` that cannot be written, before the work that fills it.

    Raises:
        CLIError: ``output`` is empty or a directory, or its directory does not exist.
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
