"""Sequence tagging (pydoc-wordseg): a ``TokenTagger`` over character ids, measured over the real
(unpadded) test characters by accuracy, NLL, ECE, F1 and epistemic uncertainty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from probtransformer.tasks._base import ECE_BINS, Evaluation, ReportContext
from probtransformer.tasks._tokens import TAGGER_FIT, TokenTask, real_steps, token_predictions
from probtransformer.tasks.classification import RELIABILITY_FILE, write_reliability


class TaggingTask(TokenTask):
    """One label per character: ``TokenTagger`` with the dataset's vocabulary. F1 is the boundary
    tag's (scikit-learn ``f1_score``, positive class 1) for two tags, else macro F1. Writes
    ``reliability.png`` over the real test characters; the report adds their reliability
    diagram."""

    name = "tagging"
    # the text recipe's learning rate (TAGGER_FIT) and the claims benchmark's budget for
    # word segmentation
    fit_preset = {**TAGGER_FIT, "batch_size": 32, "num_steps": 1000}
    files = (RELIABILITY_FILE,)
    sections = {"reliability": "Reliability"}
    headline = {
        "accuracy": "",
        "nll": "nats",
        "ece": "",
        "mean_epistemic": "nats",
        "boundary_f1": "",
        "macro_f1": "",
    }
    metrics_note = (
        "computed over the real (unpadded) characters of the test split from the posterior "
        "predictive mean: per-character accuracy, NLL in nats per character, ECE over "
        "equal-width bins of the top-class probability, F1 of the boundary tag."
    )
    printed_metrics = (
        ("accuracy", " (per character)"),
        ("nll", " nats/character"),
        ("ece", f" ({ECE_BINS} bins)"),
        ("boundary_f1", ""),
        ("macro_f1", ""),
        ("mean_epistemic", " nats"),
    )
    strip_whitespace = True  # the training text has its whitespace removed

    def model_classes(self) -> tuple[type, ...]:
        from probtransformer.models import TokenTagger

        return (TokenTagger,)

    def build_model(self, meta: dict, options: dict[str, Any], *, model: str = "auto") -> Any:
        """``TokenTagger(None, num_classes, max_len, vocab_size=len(vocab))``; see
        ``Task.build_model``."""
        from probtransformer.models import TokenTagger

        self.check_model_choice(model)
        if meta.get("vocab") is None:
            raise ValueError(
                "tagging reads token ids: its feature must be one text column (a word or "
                f"character per step), got {meta.get('in_features')} numeric feature(s); numeric "
                "sequences take one label each (--task classification)"
            )
        vocab_size = len(meta["vocab"])
        return TokenTagger(
            None, meta["num_classes"], meta["max_len"], vocab_size=vocab_size, **options
        )

    def evaluate(self, post: Any, splits: Any, draws: dict) -> Evaluation:
        """Token accuracy, NLL (nats/character), ECE, F1 and epistemic uncertainty over the real
        test steps, predicted ``TOKEN_BATCH`` sequences at a time."""
        from sklearn.metrics import f1_score

        from probtransformer import metrics

        probs, labels, epistemic, num_samples = _real_predictions(post, splits.test, draws)
        predicted = probs.argmax(-1)
        if probs.shape[-1] == 2:  # positive class 1: a word boundary follows
            f1 = {"boundary_f1": float(f1_score(labels, predicted, pos_label=1, zero_division=0.0))}
        else:
            f1 = {
                "macro_f1": float(f1_score(labels, predicted, average="macro", zero_division=0.0))
            }
        values = dict(
            accuracy=metrics.accuracy(probs, labels),
            nll=metrics.nll(probs, labels),
            ece=metrics.ece(probs, labels, n_bins=ECE_BINS, strategy="uniform"),
            ece_bins=ECE_BINS,
            **f1,
            mean_epistemic=float(epistemic.mean()),
        )

        def write(staging: Path, record: dict) -> None:
            title = f"{record['dataset']} test characters, {record['inference']}"
            write_reliability(staging, probs, labels, title)

        return Evaluation(values, {"num_test_tokens": len(labels)}, num_samples, write)

    def report(self, context: ReportContext) -> tuple[dict[str, str], int | str]:
        """The reliability diagram over the real test characters, drawn again."""
        from probtransformer.report_sections import reliability_section

        record = context.record
        probs, labels, _, used = _real_predictions(context.post, context.test, context.draws)
        title = f"{record['dataset']} test characters, {record.get('inference', '?')}"
        section = reliability_section(record, probs, labels, "characters", title)
        return {"reliability": section}, used

    def step_frame(self, index: dict, pred: Any, record: dict, names) -> Any:
        """``token``, ``prob_<tag>``, ``predicted``, ``entropy``, ``aleatoric``, ``epistemic``."""
        import pandas as pd

        tags = pred.to_dataframe(record.get("class_names")).drop(columns=["sequence", "step"])
        return pd.concat([pd.DataFrame(index), tags], axis=1)


def _real_predictions(post, data, draws: dict):
    """The predictive mean ``(M, C)``, labels ``(M,)`` and epistemic uncertainty ``(M,)``
    (nats) at the M real steps of ``data``, predicted ``TOKEN_BATCH`` sequences at a time, and
    the number of posterior draws used."""
    import torch

    probs, labels, epistemic, num_samples = [], [], [], 0
    for rows, pred in token_predictions(post, data, draws):
        probs.append(real_steps(rows, pred.mean))  # (m, C)
        labels.append(real_steps(rows, rows.y))
        epistemic.append(real_steps(rows, pred.epistemic))
        num_samples = pred.probs.shape[0]
    return torch.cat(probs), torch.cat(labels), torch.cat(epistemic), num_samples
