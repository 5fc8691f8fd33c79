"""``--help`` and argument errors are fast: they import no torch, and the library values that
help shows without it (``cli.library_defaults``) are the library's own."""

import subprocess
import sys

import pytest

from probtransformer.cli import library_defaults

#: Run the CLI, then print the heavy modules it imported.
PROBE = """
import sys
from probtransformer.cli import main
try:
    main({argv!r})
finally:
    heavy = ("torch", "pyro", "sklearn", "pandas")
    print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["fit", "--help"],
        ["serve", "--help"],
        ["fit", "--num-steps", "0"],
        ["fit", "--bogus"],
    ],
)
def test_help_and_argument_errors_import_no_torch(argv):
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=60
    )
    *_, imported = done.stderr.strip().splitlines()
    assert imported == "[]", done.stderr
    if "--help" in argv:
        assert "usage: probtransformer" in done.stdout
    else:
        assert "probtransformer: error:" in done.stderr


def test_the_tables_are_the_librarys_own():
    """If this fails, a library default changed: run ``python -m
    probtransformer.cli.library_defaults`` and ``ruff format probtransformer/cli``."""
    for name, value in library_defaults.read_library().items():
        assert getattr(library_defaults, name) == value, name
