"""Where ``probtransformer fit`` writes its run: ``--out`` chosen and checked before fitting
(``fit`` never replaces a directory it was not told to replace)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from probtransformer.cli._common import PROG, CLIError, warn
from probtransformer.rundir import is_run_dir, next_free, run_files


def out_directory(out: str | None, default: Path, *, overwrite: bool = False) -> Path:
    """The directory ``fit`` writes its run to, chosen before fitting; ``fit`` never deletes a
    run it was not told to replace.

    Args:
        out: ``--out``, or None.
        default: ``runs/<dataset>-<inference>``; when it holds a run and ``out`` is None, the
            first free ``default-2``, ``default-3``, ... is chosen instead (said on stderr).
        overwrite: ``--overwrite``: an ``out`` holding a run is replaced once the new run is
            written (said on stderr).

    Raises:
        CLIError: ``out`` holds a run and ``overwrite`` is False, or ``check_out``'s errors.
    """
    if out is None:
        target = default
        if not overwrite and is_run_dir(target):
            target = next_free(default)
            print(
                f"{PROG}: {default} holds an earlier run; this fit writes {target} "
                f"(--out {default} --overwrite replaces it)",
                file=sys.stderr,
            )
    else:
        target = Path(out)
        if is_run_dir(target) and not overwrite:
            raise CLIError(
                f"--out {target} holds an earlier run; give --overwrite to replace it, or "
                "another --out"
            )
    check_out(target)
    if is_run_dir(target):  # said before fitting: Ctrl-C now keeps it
        warn(f"--out {target} holds an earlier run; this fit replaces it once it is written")
    return target


def check_out(target: Path) -> None:
    """Fail before fitting when ``target`` cannot become the run directory.

    Raises:
        CLIError: ``target`` is a file, a non-empty directory that is not a run directory, or a
            run directory holding other files (never replaced); or its nearest existing parent
            is not a writable directory.
    """
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise CLIError(f"--out {target} exists and is not a directory")
        names = {p.name for p in target.iterdir()}
        if names and not is_run_dir(target):
            raise CLIError(
                f"--out {target} exists and is not a {PROG} run directory; refusing to replace it"
            )
        others = sorted(names - set(run_files()))
        if others:
            raise CLIError(
                f"--out {target} holds files that {PROG} did not write ({', '.join(others[:3])})"
                "; move them or choose another --out"
            )
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    unwritable = f"cannot create --out {target}: {ancestor} is not a writable directory"
    if not ancestor.is_dir():
        raise CLIError(unwritable)
    try:  # tried rather than os.access, which says yes to root everywhere (/proc included)
        tempfile.TemporaryDirectory(dir=ancestor, prefix=".probtransformer-probe-").cleanup()
    except OSError as e:
        raise CLIError(f"{unwritable} ({e})") from None
