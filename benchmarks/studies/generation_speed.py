"""Generation speed of a ``CausalLM`` posterior: the engine before the KV cache, the new engine
without the cache, and the new engine with it (issue 16's acceptance measurement).

Model: ``CausalLM`` on the pydoc-text vocabulary (101 characters, ``max_len`` 64), d_model 64,
4 heads, 2 layers, d_ff 128, fitted by 50 SVI steps (the speed does not depend on the fit).
Each engine generates ``--new`` tokens after a ``--prompt``-character prompt from the test text
with ``S = --draws`` posterior draws and greedy model-average decoding, on one thread. Tokens
per second is the median of ``--repeats`` rounds, each running the three engines in turn (so
load changes on a shared machine hit all of them alike); the ratios are the medians of the
per-round ratios against the engine before the cache, run in the same process (the cached
engine's 64 tokens take about 0.15 s, so single rounds vary by a third: 15 rounds by default).
The cached and uncached new engines' tokens are compared (equal while prompt plus output fit in
``max_len``).

``predict_per_token`` is the engine before issue 16 (``generate`` as of 674cae7): a full
``Posterior.predict`` over the last ``max_len`` tokens for every new token, which also draws the
posterior afresh at every step::

    python -m benchmarks.studies.generation_speed            # prompt 16, 64 new, S = 20
    python -m benchmarks.studies.generation_speed --new 40   # prompt + output within max_len
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from probtransformer import datasets
from probtransformer.inference import fit_svi
from probtransformer.models import CausalLM, generate


def predict_per_token(posterior, ids: torch.Tensor, max_new_tokens: int, num_samples: int):
    """Greedy model-average decoding by one ``Posterior.predict`` per token (the old engine)."""
    model, new = posterior.model, []
    for _ in range(max_new_tokens):
        context = torch.cat([ids, torch.tensor(new, dtype=torch.long)])[-model.max_len :]
        probs = posterior.predict(context[None], num_samples=num_samples, seed=0).probs
        new.append(int(probs[:, 0, -1].mean(0).argmax()))
    return new


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=16, help="prompt characters")
    parser.add_argument("--new", type=int, default=64, help="tokens to generate")
    parser.add_argument("--draws", type=int, default=20, help="posterior draws S")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    splits = datasets.load("pydoc-text", seed=0)
    model = CausalLM(
        splits.meta["vocab"], splits.meta["max_len"], d_model=64, num_heads=4, num_layers=2,
        d_ff=128,
    )  # fmt: skip
    post = fit_svi(model, splits.train, num_steps=50, batch_size=32, progress=False)
    prompt = splits.test.x[0, : args.prompt]
    engines = {
        "predict_per_token": lambda: predict_per_token(post, prompt, args.new, args.draws),
        "uncached": lambda: generate(
            post, prompt, max_new_tokens=args.new, num_samples=args.draws, cache=False
        ).token_ids.tolist(),
        "cached": lambda: generate(
            post, prompt, max_new_tokens=args.new, num_samples=args.draws, cache=True
        ).token_ids.tolist(),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for _ in range(args.repeats):  # engines interleaved: load changes hit all of them alike
        for name, run in engines.items():
            start = time.perf_counter()
            tokens[name] = run()
            times[name].append(time.perf_counter() - start)
    seconds = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: args.new / s for name, s in seconds.items()}

    def ratio(slow: str, fast: str) -> float:  # the median of the per-round ratios
        rounds = zip(times[slow], times[fast], strict=True)
        return round(statistics.median(a / b for a, b in rounds), 2)

    result = {
        "settings": vars(args) | {"max_len": model.max_len, "d_model": 64, "num_layers": 2},
        "tokens_per_second": {k: round(v, 1) for k, v in rate.items()},
        "speedup_vs_before": {k: ratio("predict_per_token", k) for k in rate},
        "speedup_per_round": [
            round(a / b, 2)
            for a, b in zip(times["predict_per_token"], times["cached"], strict=True)
        ],
        "cache_alone": ratio("uncached", "cached"),
        "cached_equals_uncached": tokens["cached"] == tokens["uncached"],
        "within_max_len": args.prompt + args.new <= model.max_len,
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
