"""Language modelling (pydoc-text): a ``CausalLM`` over characters, measured over every test token
by perplexity, NLL, next-token accuracy and epistemic uncertainty, with greedy continuations of
a few test prompts (``samples.json``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from probtransformer.tasks._base import Evaluation, ReportContext
from probtransformer.tasks._tokens import LM_FIT, TokenTask, real_steps, token_predictions

SAMPLES_FILE = "samples.json"
#: Greedy continuations of SAMPLE_TOKENS tokens after the first SAMPLE_PROMPT_LEN characters of
#: SAMPLE_PROMPTS evenly spaced test windows.
SAMPLE_PROMPTS, SAMPLE_PROMPT_LEN, SAMPLE_TOKENS = 3, 32, 80


class LanguageModelingTask(TokenTask):
    """Next-character prediction: ``CausalLM`` with the dataset's vocabulary. Writes
    ``samples.json`` (prompt, greedy continuation, mean per-token entropy and its epistemic part,
    from ``models.generate``); the report shows those samples."""

    name = "language-modeling"
    # the text recipe's learning rate (LM_FIT) and the claims benchmark's budget for
    # the character LM
    fit_preset = {**LM_FIT, "batch_size": 32, "num_steps": 1200}
    files = (SAMPLES_FILE,)
    sections = {"samples": "Generated text"}
    headline = {"accuracy": "", "nll": "nats", "mean_epistemic": "nats", "perplexity": ""}
    metrics_note = (
        "computed over every next-token prediction of the test split from the posterior "
        "predictive mean: perplexity = exp(NLL), NLL in nats per token, accuracy of the most "
        "probable next token."
    )
    printed_metrics = (
        ("perplexity", ""),
        ("nll", " nats/token"),
        ("accuracy", " (next token)"),
        ("mean_epistemic", " nats/token"),
    )

    def model_classes(self) -> tuple[type, ...]:
        from probtransformer.models import CausalLM

        return (CausalLM,)

    def build_model(self, meta: dict, options: dict[str, Any], *, model: str = "auto") -> Any:
        """``CausalLM(vocab, max_len)``; see ``Task.build_model``."""
        from probtransformer.models import CausalLM

        self.check_model_choice(model)
        return CausalLM(meta["vocab"], meta["max_len"], **options)

    def evaluate(self, post: Any, splits: Any, draws: dict) -> Evaluation:
        """Perplexity, NLL per token and next-token accuracy, accumulated batch by batch (never
        every token's probabilities at once), and greedy samples from a few test prompts."""
        from probtransformer import metrics

        total_nll, correct, epistemic, count, num_samples = 0.0, 0, 0.0, 0, 0
        for rows, pred in token_predictions(post, splits.test, draws):
            probs, labels = metrics.token_level(pred.mean, rows.y, rows.mask)  # (M, V), (M,)
            total_nll += metrics.nll(probs, labels) * len(labels)
            correct += int((probs.argmax(-1) == labels).sum())
            epistemic += float(real_steps(rows, pred.epistemic).double().sum())
            count += len(labels)
            num_samples = pred.probs.shape[0]
        nll = total_nll / count
        values = dict(
            perplexity=math.exp(nll),
            nll=nll,
            accuracy=correct / count,
            mean_epistemic=epistemic / count,
        )
        samples = _samples(post, splits.test, draws)

        def write(staging: Path, record: dict) -> None:
            (staging / SAMPLES_FILE).write_text(json.dumps(samples, indent=1) + "\n")

        lines = []
        for i, sample in enumerate(samples["samples"], start=1):
            lines.append(
                f"  sample {i}: {_clip(sample['prompt'])} -> {_clip(sample['continuation'])} "
                f"(entropy {sample['mean_entropy']:.2f}, epistemic "
                f"{sample['mean_epistemic']:.3f} nats/token)"
            )
        return Evaluation(values, {"num_test_tokens": count}, num_samples, write, lines=lines)

    def report(self, context: ReportContext) -> tuple[dict[str, str], int | str]:
        """The samples fit wrote; the metrics are those fit computed (nothing is drawn again)."""
        used = context.record.get("num_samples", "?")
        return {"samples": _samples_section(context.run_dir)}, used

    def step_frame(self, index: dict, pred: Any, record: dict, names) -> Any:
        """``token``, the most probable next token ``predicted`` and ``prob_predicted``,
        ``entropy``, ``aleatoric``, ``epistemic`` (nats)."""
        import pandas as pd

        top = pred.mean.max(-1)  # (n, T): the most probable next token and its probability
        return pd.DataFrame(
            {
                **index,
                "predicted": names(top.indices.reshape(-1).tolist()),
                "prob_predicted": top.values.reshape(-1).numpy(),
                "entropy": pred.entropy.reshape(-1).numpy(),
                "aleatoric": pred.aleatoric.reshape(-1).numpy(),
                "epistemic": pred.epistemic.reshape(-1).numpy(),
            }
        )


def _samples(post, test, draws: dict) -> dict[str, Any]:
    """Greedy continuations of the first characters of a few evenly spaced test windows."""
    from probtransformer.datasets import decode_text
    from probtransformer.models import generate

    rows = sorted(set(np.linspace(0, len(test) - 1, SAMPLE_PROMPTS).round().astype(int).tolist()))
    options = dict(max_new_tokens=SAMPLE_TOKENS, strategy="greedy", seed=draws.get("seed", 0))
    if "num_samples" in draws:
        options["num_samples"] = draws["num_samples"]
    prompts = []
    for row in rows:
        ids = test.x[row, :SAMPLE_PROMPT_LEN]
        prompts.append(ids if test.mask is None else ids[test.mask[row, :SAMPLE_PROMPT_LEN]])
    generations = generate(post, prompts, **options)  # one batch, ragged prompts allowed
    samples = [
        dict(
            test_row=row,
            prompt=decode_text(ids, post.model.vocab),
            continuation=generation.text,
            mean_entropy=float(generation.entropy.mean()),
            mean_aleatoric=float(generation.aleatoric.mean()),
            mean_epistemic=float(generation.epistemic.mean()),
        )
        for row, ids, generation in zip(rows, prompts, generations, strict=True)
    ]
    return dict(options, samples=samples)


def _clip(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[: width - 1] + "…")


def _samples_section(run_dir: Path) -> str:
    """The table of ``samples.json`` (or a note that the run has none readable)."""
    from probtransformer.report_sections import table

    path = run_dir / SAMPLES_FILE
    try:
        samples = json.loads(path.read_text(encoding="utf-8"))
        rows = [
            (
                str(s["test_row"]),
                s["prompt"].replace("\n", "⏎"),
                s["continuation"].replace("\n", "⏎"),
                f"{s['mean_entropy']:.3f}",
                f"{s['mean_epistemic']:.4f}",
            )
            for s in samples["samples"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return f"<p>This run has no readable {SAMPLES_FILE}.</p>"
    header = ("test row", "prompt", "continuation", "mean entropy", "mean epistemic")
    return (
        f'<p class="note">{samples.get("strategy", "?")} continuations of '
        f"{samples.get('max_new_tokens', '?')} tokens after the first characters of test "
        "windows (written by fit), with the mean per-token entropy of the posterior predictive "
        "and its epistemic part (nats).</p>\n" + table(header, rows, text_columns=3)
    )
