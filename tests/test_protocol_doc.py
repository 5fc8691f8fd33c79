"""The examples of ``docs/protocol.md`` are real: the minimal model fits and recovers a known
slope; the local-latent model keeps its per-row draws."""

import re
from pathlib import Path

import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_mcmc, fit_svi

DOC = Path(__file__).parents[1] / "docs" / "protocol.md"


def _namespace() -> dict:
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


def test_minimal_model_recovers_a_known_slope():
    torch.manual_seed(0)
    x = torch.randn(200, 2)
    y = x @ torch.tensor([1.5, -2.0]) + 0.5 * torch.randn(200)
    post = fit_svi(
        _namespace()["Linear"](2), SequenceData(x, y), num_steps=800, lr=0.05, progress=False
    )
    weight = post.draws(200)["weight"].flatten(0, 1).mean(0)
    torch.testing.assert_close(weight, torch.tensor([1.5, -2.0]), atol=0.15, rtol=0)


def test_local_latents_are_kept_with_their_obs_dim():
    data = SequenceData(
        torch.tensor([[15.0], [10.0], [16.0], [11.0], [9.0], [11.0], [10.0], [18.0]]),
        torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]),
    )
    post = fit_mcmc(
        _namespace()["EightSchools"](), data, num_chains=1, num_warmup=20, num_samples=10,
        progress=False,
    )  # fmt: skip
    assert post.samples["theta"].shape == (1, 10, 8)
    idata = post.to_inference_data(data, attention_obs=0)
    assert idata.posterior["theta"].dims == ("chain", "draw", "obs")
