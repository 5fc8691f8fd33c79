"""The wheel ships every module of the source tree, and each one imports from the wheel alone."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.architecture.test_import_direction import FOLDERS, ROOT, _module_name


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("probtransformer-*.whl")
    return path


def _source_modules() -> set[str]:
    return {_module_name(p) for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}


def test_wheel_holds_every_module(wheel):
    with zipfile.ZipFile(wheel) as archive:
        shipped = {_wheel_module(name) for name in archive.namelist() if name.endswith(".py")}
    assert _source_modules() - shipped == set()


def _wheel_module(name: str) -> str:
    parts = name.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_every_module_imports_from_the_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    modules = sorted(m for m in _source_modules() if not m.endswith(".__main__"))  # scripts
    script = (
        "import importlib, sys\n"
        f"target = {str(target)!r}\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    assert module.__file__.startswith(target), (name, module.__file__)\n"
        "print(len(sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
