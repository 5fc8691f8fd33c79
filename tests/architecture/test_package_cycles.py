"""No cycle between the parts of the package: ``probtransformer.<name>`` for every subpackage
and top-level module (cli, report, serving, inference, models, datasets, data, rundir, ...).

The graph is read statically from every import of every module (``imports_of``: top level, in
functions, ``import_module`` strings), so a lazy import cannot hide a cycle. A cycle of parts
means neither can be understood, tested or moved without the other, even where Python's
import order happens to cope.
"""

from collections import defaultdict
from pathlib import Path

from tests.architecture.test_import_direction import ROOT, SOURCES, _module_name, imports_of


def _part(module: str) -> str | None:
    """``name`` of ``probtransformer.name...``; None for the package root and other packages."""
    parts = module.split(".")
    return parts[1] if parts[0] == "probtransformer" and len(parts) > 1 else None


def part_graph(sources: list[Path]) -> dict[str, dict[str, str]]:
    """``{part: {imported part: an import making that edge, "module -> name"}}``."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sources:
        module = _module_name(path)
        here = _part(module)
        if here is None:
            continue
        for name in sorted(imports_of(path)):
            there = _part(name)
            if there is not None and there != here:
                graph[here].setdefault(there, f"{module} -> {name}")
    return dict(graph)


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of ``graph`` as its parts in order, the first repeated at the end, or None.

    Depth-first search over the parts in sorted order, so the cycle found is the same each run.
    """
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for succ in sorted(graph.get(node, {})):
            if succ in on_path:
                return [*path[path.index(succ) :], succ]
            if succ not in done:
                cycle = visit(succ)
                if cycle is not None:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None


def _described(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    """The cycle with one import per edge, for the failure message."""
    edges = [f"  {a} -> {b}: {graph[a][b]}" for a, b in zip(cycle, cycle[1:], strict=False)]
    return "package cycle " + " -> ".join(cycle) + "\n" + "\n".join(edges)


def test_no_package_cycle():
    graph = part_graph(SOURCES)
    cycle = find_cycle(graph)
    assert cycle is None, _described(graph, cycle)


def test_the_graph_has_the_layers_edges():
    """The graph is read, not empty: the CLI reaches the report and the server, and both the
    run directories."""
    graph = part_graph(SOURCES)
    assert {"report", "serving", "rundir"} <= set(graph["cli"])
    assert "rundir" in graph["report"] and "rundir" in graph["serving"]


def test_a_reintroduced_cycle_is_found_and_named(monkeypatch):
    """The run directories importing the CLI again (as ``cli/rundir.py`` once made the report
    and the server import the CLI) is a cycle, named with the imports that make it."""
    fake = ROOT / "probtransformer" / "rundir.py"
    original = Path.read_text
    added = "\ndef _late():\n    from probtransformer.cli._common import PROG\n"
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: original(self, *a, **k) + (added if self == fake else ""),
    )
    graph = part_graph(SOURCES)
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"cli", "rundir"} <= set(cycle)
    message = _described(graph, cycle)
    assert "probtransformer.rundir -> probtransformer.cli._common" in message


def test_find_cycle_on_small_graphs():
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}}) is None
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ""}, "b": {"b2": ""}, "b2": {"b": ""}}) == ["b", "b2", "b"]
