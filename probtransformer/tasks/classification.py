"""Sequence classification (digits, digits-patches, the UCR/UEA sets): a ``SequenceClassifier``
measured by accuracy, NLL, ECE, Brier score and epistemic uncertainty on the test split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from probtransformer.tasks._base import ECE_BINS, Evaluation, ReportContext
from probtransformer.tasks._features import FeatureTask

RELIABILITY_FILE = "reliability.png"


def write_reliability(staging: Path, probs, labels, title: str) -> None:
    """``reliability.png`` of top-class probabilities ``probs`` ``(M, C)`` and ``labels``
    ``(M,)`` over ``ECE_BINS`` equal-width bins, into the run directory being staged."""
    from probtransformer import plots

    figure = plots.reliability_figure(probs, labels, n_bins=ECE_BINS, title=title)
    plots.save_figure(figure, staging / RELIABILITY_FILE)


class ClassificationTask(FeatureTask):
    """One label per sequence: ``SequenceClassifier`` (2-D patch positions when the dataset has
    a ``grid``; the mask of ragged sets). Writes ``reliability.png``; the report adds the
    reliability diagram and risk-coverage curves of selective prediction."""

    name = "classification"
    files = (RELIABILITY_FILE,)
    sections = {
        "reliability": "Reliability",
        "risk-coverage": "Selective prediction: risk–coverage",
    }
    headline = {"accuracy": "", "nll": "nats", "ece": "", "brier": "", "mean_epistemic": "nats"}
    metrics_note = (
        "computed on the test split from the posterior predictive mean (NLL in nats; ECE over "
        "equal-width bins of the top-class probability)."
    )
    printed_metrics = (
        ("accuracy", ""),
        ("nll", " nats"),
        ("ece", f" ({ECE_BINS} bins)"),
        ("brier", ""),
        ("mean_epistemic", " nats"),
    )
    names_model = False  # one model class: the dataset says it all

    def model_classes(self) -> tuple[type, ...]:
        from probtransformer.models import SequenceClassifier

        return (SequenceClassifier,)

    def build_model(self, meta: dict, options: dict[str, Any], *, model: str = "auto") -> Any:
        """``SequenceClassifier(in_features, num_classes, max_len)``, or with
        ``vocab_size=len(vocab)`` for token ids (a text column of ``fit --data``); see
        ``Task.build_model``."""
        from probtransformer.models import SequenceClassifier

        self.check_model_choice(model)
        options = dict(options)
        if meta.get("grid") is not None:  # image patches: 2-D positions
            options["grid"] = tuple(meta["grid"])
        if meta.get("vocab") is not None:
            options["vocab_size"] = len(meta["vocab"])
        return SequenceClassifier(
            meta.get("in_features"), meta["num_classes"], meta["max_len"], **options
        )

    def evaluate(self, post: Any, splits: Any, draws: dict) -> Evaluation:
        """Accuracy, NLL (nats), ECE, Brier score and mean epistemic uncertainty (nats) of the
        test predictive mean ``(N, C)``; ``reliability.png`` from the same predictions."""
        from probtransformer import metrics

        test = splits.test
        pred = post.predict(test.x, test.mask, **draws)
        probs = pred.mean  # (N, C)
        values = dict(
            accuracy=metrics.accuracy(probs, test.y),
            nll=metrics.nll(probs, test.y),
            ece=metrics.ece(probs, test.y, n_bins=ECE_BINS, strategy="uniform"),
            ece_bins=ECE_BINS,
            brier=metrics.brier(probs, test.y),
            mean_epistemic=float(pred.epistemic.mean()),
        )

        def write(staging: Path, record: dict) -> None:
            title = f"{record['dataset']} test, {record['inference']}"
            write_reliability(staging, probs, test.y, title)

        label = f" (label {int(test.y[0])})"
        return Evaluation(values, {}, pred.probs.shape[0], write, label, prediction=pred)

    def report(self, context: ReportContext) -> tuple[dict[str, str], int | str]:
        """Reliability and risk-coverage of the test predictions, drawn again with the run's
        seed and draws."""
        from probtransformer.report_sections import reliability_section, risk_coverage_section

        record, test = context.record, context.test
        pred = context.post.predict(test.x, test.mask, **context.draws)
        title = f"{record['dataset']} test, {record.get('inference', '?')}"
        sections = {
            "reliability": reliability_section(record, pred.mean, test.y, "sequences", title),
            "risk-coverage": risk_coverage_section(record, pred, test),
        }
        return sections, pred.probs.shape[0]

    def prediction_frame(self, pred: Any, record: dict) -> Any:
        """``prob_<class>``, ``predicted``, ``entropy``, ``aleatoric``, ``epistemic`` (nats)."""
        return pred.to_dataframe(record.get("class_names"))
