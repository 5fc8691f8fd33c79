"""Every Python example of the README runs, in order, in one namespace (as a reader pastes them).

The examples' fits are cut short (a few steps, a few draws, small data) by wrapping the library's
fit functions and ``datasets.load``: what is tested is that every name, call and attribute the
README shows exists and works together, not the figures (``benchmarks/`` measures those).
"""

import dataclasses
import functools
import re
from pathlib import Path

import pytest

import probtransformer.datasets
import probtransformer.inference
from probtransformer.inference import NUTS, Posterior

README = Path(__file__).parents[1] / "README.md"

#: Keyword arguments each fit is cut to (the smaller of the example's and these).
CAPS = {
    "fit_svi": {"num_steps": 10},
    "fit_map": {"num_steps": 10},
    "fit_mc_dropout": {"num_steps": 10},
    "fit_ensemble": {"num_steps": 10, "n_members": 2},
    "fit_mcmc": {"num_warmup": 5, "num_samples": 5, "map_steps": 10},
    "fit_mile": {"num_warmup": 30, "num_samples": 3, "thinning": 2, "chains_per_member": 1},
    "fit_laplace": {"num_samples": 10},
    "fit_mola": {"num_steps": 10, "n_members": 2, "num_samples": 10},
}
#: Rows kept of each split by the wrapped ``load``.
ROWS = {"train": 120, "val": 40, "test": 40}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _capped(fit, caps):
    @functools.wraps(fit)
    def run(*args, **kwargs):
        for key, cap in caps.items():
            kwargs[key] = min(kwargs.get(key, cap), cap)
        kernel = kwargs.get("kernel", NUTS() if fit.__name__ == "fit_mcmc" else None)
        if isinstance(kernel, NUTS):  # short trajectories
            kwargs["kernel"] = dataclasses.replace(kernel, max_tree_depth=3)
        return fit(*args, **{**kwargs, "progress": False})

    return run


def _small_load(load):
    @functools.wraps(load)
    def run(*args, **kwargs):
        splits = load(*args, **kwargs)
        rows = {part: getattr(splits, part)[:n] for part, n in ROWS.items()}
        return dataclasses.replace(splits, **rows)

    return run


def test_readme_has_the_examples():
    assert len(python_blocks(README.read_text())) >= 4


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_python_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("statsmodels")  # the sunspots example needs the [datasets] extra
    monkeypatch.chdir(tmp_path)  # post.save("my-posterior") writes here
    for name, caps in CAPS.items():
        monkeypatch.setattr(
            probtransformer.inference, name, _capped(getattr(probtransformer.inference, name), caps)
        )
    monkeypatch.setattr(
        probtransformer.datasets, "load", _small_load(probtransformer.datasets.load)
    )
    # the attention of one training sequence, not four: az.summary over it is the slow part
    export = Posterior.to_inference_data
    monkeypatch.setattr(
        Posterior, "to_inference_data", lambda *a, **k: export(*a, **{"attention_obs": 1, **k})
    )
    namespace: dict = {}
    for i, block in enumerate(python_blocks(README.read_text())):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README python block {i} failed:\n{block}") from e
    assert (tmp_path / "my-posterior" / "posterior.json").is_file()
