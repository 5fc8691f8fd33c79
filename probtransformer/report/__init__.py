"""A self-contained HTML report of a run directory written by ``probtransformer fit``.

``write_report(run_dir)`` writes ``run_dir/report.html``: one file with inline CSS and every
figure embedded as a base64 PNG ``data:`` URI, so it can be mailed or archived alone. It
reloads the run's posterior and its dataset split (dataset, seed and ``num_train`` from
``metrics.json``) and draws the test-split predictions again with the run's seed and number of
draws, so its numbers match ``metrics.json``. Sections, each an ``<h2>`` with a stable ``id``,
those that apply to the run's task (``TASK_SECTIONS``) in this order:

- ``metrics``: the numbers of ``metrics.json``;
- the sections of the run's task (``Task.sections``, ``Task.report``):
  - ``reliability`` (classification, tagging): reliability diagram of the test predictive mean
    (tagging: over the real test characters);
  - ``risk-coverage`` (classification): risk-coverage curves of selective prediction by total
    predictive entropy and by epistemic uncertainty (mutual information), AURC in the legend,
    and the accuracy of the predictions kept at a few coverages (``Prediction.reject``);
  - ``forecast`` (forecasting): fan chart of a few test forecasts (predictive mean, 90%
    predictive interval, truth) and the interval coverage per horizon step;
  - ``samples`` (language modeling): the generated test continuations of ``samples.json``;
- ``attention``: posterior mean and sd of the attention of the first test sequences per layer
  and head, and the mean posterior sd per layer and head;
- ``head-importance``: the posterior of the head gates (``Posterior.head_importance``) when the
  model has them;
- ``diagnostics``: the aggregated table and verdict of ``Posterior.diagnose`` on the training
  rows the fit saw (PSIS-LOO included).
"""

from probtransformer.report.catalog import SECTIONS, TASK_SECTIONS
from probtransformer.report.page import SETTINGS_FIRST, STYLE, write_report
from probtransformer.report.posterior_sections import ATTENTION_EXAMPLES, NO_GATES

__all__ = [
    "ATTENTION_EXAMPLES",
    "NO_GATES",
    "SECTIONS",
    "SETTINGS_FIRST",
    "STYLE",
    "TASK_SECTIONS",
    "write_report",
]
