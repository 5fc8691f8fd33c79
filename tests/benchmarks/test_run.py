"""The benchmark suite's smoke run (what CI checks: every section runs at quick sizes and
writes its tables), its cache and the generated block of BENCHMARKS.md."""

import json

import pytest

from benchmarks import _suite, run


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    results = tmp_path_factory.mktemp("bench")
    status = run.main(["--quick", "--results", str(results)])
    return results, status


def test_quick_run_measures_every_section_and_writes_its_tables(quick_results):
    results, status = quick_results
    assert status == 0
    text = (results / "BENCHMARKS.md").read_text()
    assert text.count(run.BEGIN) == 1 and text.count(run.END) == 1
    for name in run.SECTIONS:
        rows = json.loads((results / f"{name}.json").read_text())
        assert rows, name
        for key, row in rows.items():
            assert row["command"] == (
                f"python -m benchmarks.run --only {name}/{key} --force --quick --results {results}"
            )
            assert row["seconds_total"] > 0 and row["torch"]
        title = run.section_module(name).TITLE
        part = text.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
        assert any(line.startswith("|") for line in part.splitlines()), name
    assert "Not measured yet" not in text


def test_a_rerun_skips_cached_rows_and_only_selects_by_prefix(quick_results, capsys):
    results, _ = quick_results
    before = {p.name: p.read_text() for p in results.glob("*.json")}
    assert run.main(["--quick", "--results", str(results), "--only", "speed"]) == 0
    assert " ..." not in capsys.readouterr().out  # nothing measured again
    assert {p.name: p.read_text() for p in results.glob("*.json")} == before
    assert run._selected("claims/lm/base/0", ["claims/lm"])
    assert not run._selected("claims/lmx/base/0", ["claims/lm"])
    assert run._selected("speed/d64-T8", [])


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        run.main(["--only", "nonsense"])
    assert e.value.code == 2
    assert "unknown sections ['nonsense']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.main(["--budget", "0"])


def test_generated_block_replaces_only_its_markers(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# title\n\nhand-written\n\n{run.BEGIN}\nold\n{run.END}\n\n## later history\n")
    run.write_markdown(f"{run.BEGIN}\nnew\n{run.END}\n", md)
    assert md.read_text() == (
        f"# title\n\nhand-written\n\n{run.BEGIN}\nnew\n{run.END}\n\n## later history\n"
    )
    fresh = tmp_path / "fresh.md"
    run.write_markdown(f"{run.BEGIN}\nnew\n{run.END}\n", fresh)
    assert fresh.read_text().endswith(f"{run.BEGIN}\nnew\n{run.END}\n")


def test_store_keeps_rows_written_by_another_process(tmp_path):
    cache = tmp_path / "s.json"
    _suite.store(cache, "a", {"x": 1})
    cache.write_text(json.dumps({"a": {"x": 1}, "b": {"x": 2}}))  # another process added b
    rows = _suite.store(cache, "c", {"x": 3})
    assert set(rows) == {"a", "b", "c"}
    assert _suite.budgeted_steps(0.5, 10.0, max_steps=100, min_steps=5) == 20
    assert _suite.budgeted_steps(0.5, 1.0, max_steps=100, min_steps=5) == 5


def test_a_broken_cache_is_named_and_the_other_sections_still_render(tmp_path, capsys):
    (tmp_path / "speed.json").write_text('{"d32-T8": {"ratio": 1.3')
    assert run.main(["--quick", "--results", str(tmp_path), "--only", "speed/d32-T8"]) == 1
    assert "speed.json is not valid JSON" in capsys.readouterr().err
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "Cannot be rendered from `speed.json`" in text
    assert "Not measured yet: `python -m benchmarks.run --only claims`" in text


def test_an_only_that_matches_no_row_fails(tmp_path, capsys):
    assert run.main(["--quick", "--results", str(tmp_path), "--only", "quality/digits/svi"]) == 1
    assert "no row of the cpu sections has such a key" in capsys.readouterr().err


def test_bad_results_and_device_combinations_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run.main(["--results", ""])
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert run.main(["--quick", "--results", str(not_a_dir)]) == 2
    assert "cannot create the directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.main(["--device", "cuda", "--only", "claims"])
    md = tmp_path / "half.md"
    md.write_text(f"text\n{run.BEGIN}\nno end marker\n")
    with pytest.raises(ValueError, match="two markers once each"):
        run.write_markdown(f"{run.BEGIN}\nnew\n{run.END}\n", md)
    assert md.read_text() == f"text\n{run.BEGIN}\nno end marker\n"


def _loss_row(trace: list[float]) -> dict:
    return {"loss_trace": trace, "loss_trace_steps": list(range(10, 10 * len(trace) + 1, 10)),
            "diverged_at": None}  # fmt: skip


def test_layer_norm_convergence_says_when_noln_never_learned():
    """noln's loss rises from base's start to 1,900 (1,501 over its last 5 points): both reach
    that at their first point, so the steps would tie (a "within noise" verdict); the verdict
    says noln did not learn."""
    from benchmarks import claims

    base = [_loss_row([100.0 - 9 * i + s for i in range(10)]) for s in range(3)]
    noln = [_loss_row([100.0 + 200 * i + s for i in range(10)]) for s in range(3)]
    figures = claims.layer_norm_figures(base, noln)
    assert figures["median_steps_base"] == figures["median_steps_noln"] == 10
    assert figures["convergence_verdict"].startswith(
        "yes (noln's median final loss 1,501.0 is above base's first recorded loss 100.0"
    )
    assert "noln did not learn" in figures["convergence_verdict"]
    learning = [_loss_row([100.0 - 5 * i + s for i in range(10)]) for s in range(3)]
    assert "did not learn" not in claims.layer_norm_figures(base, learning)["convergence_verdict"]
