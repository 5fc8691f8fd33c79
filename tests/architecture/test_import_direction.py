"""Data and imports flow one way: building blocks -> models -> inference -> tasks -> run
directories -> report, the scikit-learn wrappers, serving (and its client) -> cli.

Every import of every module is read with the AST, including imports inside functions and
``importlib.import_module("...")`` strings, so a lazy import cannot hide a wrong direction.
Every module belongs to a layer (``LAYERS``): a new top-level module must be placed.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

#: Installed name of each top-level source folder (``models/`` installs as
#: ``probtransformer.models``; see ``[tool.setuptools.package-dir]``).
FOLDERS = {
    "probtransformer": "probtransformer",
    "models": "probtransformer.models",
    "inference": "probtransformer.inference",
}

#: The building blocks: pure, they know nothing of fitting, tasks or the command line.
BUILDING_BLOCKS = (
    "priors",
    "layers",
    "attention",
    "block",
    "circuits",
    "kv_cache",
    "embedding",
    "encoder",
    "positional",
    "metrics",
    "plots",
    "validation",
    "_io",
    "_progress",
    "data",
    "datasets",
    "methods",  # the inference methods' names: no torch
    "report_sections",  # HTML pieces the tasks render their report sections with
)

#: The layer of each ``probtransformer.<name>`` (package or module).
LAYERS = {
    **dict.fromkeys(BUILDING_BLOCKS, "building block"),
    "models": "models",
    "inference": "inference",
    "tasks": "tasks",
    "rundir": "run directory",
    "report": "report",
    "sklearn": "sklearn",
    "serving": "serving",
    "client": "serving",
    "cli": "cli",
    "__main__": "cli",
}

#: Packages each layer must never import.
#: The server and its client sit above the run directories: nothing below imports them.
SERVING = ("probtransformer.serving", "probtransformer.client")
#: The applications over a run directory and over the library: nothing below imports them.
APPLICATIONS = ("probtransformer.report", "probtransformer.sklearn", "probtransformer.cli")
#: The dataset registry: loading it imports every dataset's loader. Models and inference take
#: ``SequenceData`` from ``probtransformer.data``.
REGISTRY = ("probtransformer.datasets",)
FORBIDDEN = {
    "package root": (
        "probtransformer.inference",
        "probtransformer.tasks",
        "probtransformer.rundir",
        *APPLICATIONS,
        *SERVING,
    ),
    "building block": (
        "probtransformer.models",
        "probtransformer.inference",
        "probtransformer.tasks",
        "probtransformer.rundir",
        *APPLICATIONS,
        *SERVING,
    ),
    "models": (
        "probtransformer.inference",
        "probtransformer.tasks",
        "probtransformer.rundir",
        *APPLICATIONS,
        *SERVING,
        *REGISTRY,
    ),
    "inference": (
        "probtransformer.tasks",
        "probtransformer.rundir",
        *APPLICATIONS,
        *SERVING,
        *REGISTRY,
    ),
    "tasks": ("probtransformer.rundir", *APPLICATIONS, *SERVING),
    "run directory": (*APPLICATIONS, *SERVING),
    "report": ("probtransformer.sklearn", "probtransformer.cli", *SERVING),
    "sklearn": (
        "probtransformer.tasks",
        "probtransformer.rundir",
        "probtransformer.report",
        "probtransformer.cli",
        *SERVING,
    ),
    "serving": ("probtransformer.report", "probtransformer.sklearn", "probtransformer.cli"),
    "cli": (),
}

#: Imports that break a rule, each waiting for its owner's change (remove the entry with it):
#: the MCMC driver and MILE still take SequenceData from the registry (issue 45 item 6; the
#: MCMC rewrite changes those lines: ``from probtransformer.data import SequenceData``).
KNOWN: set[str] = set()


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [FOLDERS[folder], *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str | None:
    """The layer of ``module``: ``LAYERS`` of its second name, "package root" for
    ``probtransformer`` itself, None for a name outside ``LAYERS``."""
    parts = module.split(".")
    if parts == ["probtransformer"]:
        return "package root"
    return LAYERS.get(parts[1]) if parts[0] == "probtransformer" and len(parts) > 1 else None


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports: top level, in functions, and ``import_module`` strings
    (``from a import b`` counts as ``a`` and ``a.b``)."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node, path.name == "__init__.py")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
                elif isinstance(arg, ast.JoinedStr):  # f"pkg.{name}": its constant prefix
                    head = arg.values[0] if arg.values else None
                    if isinstance(head, ast.Constant):
                        found.add(str(head.value).rstrip("."))
    return found


SOURCES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _violations(path: Path) -> list[str]:
    layer = _layer(_module_name(path))
    if layer is None:
        return []
    return sorted(
        f"{_module_name(path)} ({layer}) imports {name}"
        for name in imports_of(path)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[layer])
    )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path):
    assert [v for v in _violations(path) if v not in KNOWN] == []


def test_every_module_has_a_layer():
    unplaced = sorted(_module_name(p) for p in SOURCES if _layer(_module_name(p)) is None)
    assert unplaced == [], "add each to LAYERS (tests/architecture/test_import_direction.py)"


def test_the_reader_sees_lazy_and_string_imports(monkeypatch):
    """The checker itself catches the hiding places: a function-level import, a relative import
    and an ``import_module`` string."""
    fake = ROOT / "probtransformer" / "layers.py"
    source = (
        "import importlib\n"
        "def f():\n"
        "    from probtransformer.inference import fit_svi\n"
        "    from .cli import main\n"
        "    return importlib.import_module('probtransformer.tasks.classification')\n"
    )
    original = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: source if self == fake else original(self, *a, **k)
    )
    assert _violations(fake) == [
        "probtransformer.layers (building block) imports probtransformer.cli",
        "probtransformer.layers (building block) imports probtransformer.cli.main",
        "probtransformer.layers (building block) imports probtransformer.inference",
        "probtransformer.layers (building block) imports probtransformer.inference.fit_svi",
        "probtransformer.layers (building block) imports probtransformer.tasks.classification",
    ]


def test_the_methods_table_names_public_fit_functions():
    """``probtransformer.methods`` names each method's fit function without importing torch;
    every name must be a public function of ``probtransformer.inference``."""
    import probtransformer.inference as inference
    from probtransformer.methods import LAPLACE_BASED, MAP_BASED, METHODS

    for name, function in METHODS.items():
        assert function in inference.__all__ and callable(getattr(inference, function)), name
    assert set(MAP_BASED) <= set(METHODS) and set(LAPLACE_BASED) <= set(METHODS)
    assert not set(MAP_BASED) & set(LAPLACE_BASED)
