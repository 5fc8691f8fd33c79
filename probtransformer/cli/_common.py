"""What every command of the CLI shares: its name, its error type and its output helpers."""

from __future__ import annotations

import sys
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
