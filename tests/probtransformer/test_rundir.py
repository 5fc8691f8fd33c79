"""The run-directory format below the CLI (probtransformer.rundir): its write error is its own,
and the CLI says it in terms of ``--out`` as before the move."""

import argparse
import contextlib
from pathlib import Path

import pytest

from probtransformer import rundir
from probtransformer.cli import _main


@contextlib.contextmanager
def _full_disk(target):
    raise OSError(28, "No space left on device")
    yield  # pragma: no cover


def test_write_run_raises_its_own_error_naming_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "staged_directory", _full_disk)
    with pytest.raises(rundir.RunWriteError) as caught:
        rundir.write_run(tmp_path / "run", None, None, {}, {}, None, None)
    assert caught.value.path == (tmp_path / "run").absolute()
    assert caught.value.reason == "No space left on device"
    assert (
        str(caught.value)
        == f"cannot write run directory {tmp_path / 'run'}: No space left on device"
    )
    assert isinstance(caught.value, OSError)


def test_the_cli_names_out_when_the_run_cannot_be_written(monkeypatch, capsys, one_error_line):
    def handler(args):
        raise rundir.RunWriteError(Path("/runs/x"), "Permission denied")

    class Parser:
        def parse_args(self, argv):
            return argparse.Namespace(handler=handler)

    monkeypatch.setattr(_main, "build_parser", Parser)
    assert _main.main(["fit"]) == 2
    assert one_error_line(capsys) == (
        "probtransformer: error: cannot write --out /runs/x: Permission denied"
    )
