"""Command-line interface: ``probtransformer fit | diagnose | predict | report | generate | serve``.

Commands:
    fit       Fit the model of the dataset's task (``datasets.load(name).meta["task"]``) by SVI,
              MAP, MCMC (ChEES, MCLMC, NUTS, HMC), MC dropout or a deep ensemble and write a
              run directory (default ``runs/<dataset>-<inference>``, or the first free
              ``-2``, ``-3``, ... when that holds a run; a given ``--out`` holding a run is
              replaced only with ``--overwrite``):

              - classification (digits, digits-patches, the UCR/UEA sets): ``SequenceClassifier``
                (2-D patch positions for digits-patches; the mask of ragged sets);
              - tagging (pydoc-wordseg): ``TokenTagger`` over character ids;
              - language-modeling (pydoc-text): ``CausalLM`` over characters;
              - forecasting (sunspots, co2, macrodata): ``SequenceRegressor`` (last-step
                pooling, the dataset's standardisation), or ``Seq2Seq`` with ``--model seq2seq``.

              Every run directory holds::

                  metrics.json        test-split metrics of the task (below), sizes, fit seconds,
                                      settings (mcmc: sampler settings, ``num_draws`` requested
                                      and ``chains_kept`` x ``draws_per_chain`` kept per chain,
                                      divergences, ``partial``; chees and mclmc: ``init``,
                                      ``num_starts``, ``chain_gradients`` and the ``adapted_*``
                                      step size and trajectory length or L), ``task`` and
                                      ``model``
                  inference_data.nc   ArviZ InferenceData (posterior, log_likelihood of the
                                      training data, predictions for the test split; mcmc:
                                      sample_stats per draw; tagging and language models: the
                                      first 500 training and test sequences,
                                      ``inference_data_rows``)
                  posterior/          the fitted posterior (``load_posterior``)
                  attention.png       posterior mean and std of the attention of test example 0
                  diagnostics.json    the aggregated table and verdict of ``Posterior.diagnose``
                                      on the training rows (what ``diagnose`` prints; runs
                                      written before it was added lack it)

              and by task:

              - classification: accuracy, nll, ece (15 equal-width bins), brier,
                mean_epistemic; ``reliability.png``;
              - tagging, over the real (unpadded) test characters: token accuracy, nll
                (nats/token), ece, boundary_f1 (scikit-learn ``f1_score``, positive class 1 =
                word boundary), mean_epistemic; ``reliability.png`` over those characters;
              - language-modeling, over every test token: perplexity, nll (nats/token),
                next-token accuracy, mean_epistemic; ``samples.json``: greedy continuations of
                3 test prompts with their mean per-token entropy (``generate``);
              - forecasting, in the data's units over every (origin, step) of the test split:
                rmse and mae of the predictive mean, interval_coverage and interval_width of
                the 90% predictive interval, crps (from the predictive samples);
                ``predictions.csv`` (origin, step, period, mean, lower, upper, y) and
                ``forecast.png`` (fan chart of a few test forecasts).

              Token-level predictions are made 32 sequences at a time
              (``tasks._tokens.TOKEN_BATCH``): their probabilities are (draws, sequences, steps,
              vocabulary).
              The run is written to a temporary directory next to the target and renamed at the
              end, so an interrupted or failed run never leaves a half-written directory; an
              existing run directory is replaced only after success. Ctrl-C during MCMC sampling
              keeps the draws so far: the run is written and marked partial.
    diagnose  Reload a run's posterior and training data and print the aggregated diagnostics
              table, the verdict and a PSIS-LOO line.
    predict   Posterior predictive of a run for new inputs, as CSV. Classification and
              forecasting runs read ``.npy`` of shape (N, T, F), or ``.csv`` with one flattened
              sequence of T*F values per row; classification writes ``prob_<class>``,
              ``predicted``, ``entropy``, ``aleatoric``, ``epistemic`` (nats), forecasting
              ``mean``, ``std``, ``aleatoric``, ``epistemic`` (variances), ``lower``, ``upper``
              (90% predictive interval) per horizon step. Tagging and language-model runs read
              a ``.npy`` of int token ids (N, T) or a ``.txt`` file with one sequence per line
              (tagging: whitespace removed, as in training) and write one row per (sequence,
              step).
    report    Write ``report.html`` into a run directory: one self-contained page (inline CSS,
              figures as base64 PNGs) with the metrics, the figures that apply to the task
              (reliability, risk-coverage, forecast fan chart, generated samples), posterior
              attention, head importance and diagnostics
              (``probtransformer.report.write_report``). A later ``fit --out`` over the same
              directory replaces the whole run, report included.
    generate  Text from a language-model run (``models.generate``): the prompt and its
              continuation, then each generated token's entropy split into aleatoric and
              epistemic parts (nats), as a table or a CSV file.
    serve     Serve a run over HTTP (``probtransformer.serving``; the ``serve`` extra): ``POST
              /predict`` (per row: probabilities or predictive mean, entropy split into
              aleatoric and epistemic parts, intervals, abstention, attention, per-draw
              values), ``POST /generate`` (language-model runs, server-sent events),
              ``GET /health``, ``GET /metadata``, OpenAPI at ``/docs``. Binds 127.0.0.1 unless
              told otherwise; ``--api-key-env`` requires a bearer key. Concurrent requests with
              equal draws and flags share one vectorized pass (``serving.batcher``).
              ``probtransformer.client.Client`` returns ``Posterior.predict``'s objects.

Each task family is a ``probtransformer.tasks.Task`` (model, metrics, run files, report
sections, input files); the commands here only call it. Model and fit options left unset take
the library defaults (the task's model, ``fit_svi``, ``fit_mcmc``), so tuning the library tunes
the CLI; ``probtransformer fit --help`` shows them.
``--inference mcmc`` is the exception where those defaults would run for hours: unless told
otherwise it fits the quality benchmark's d_model-32 classifier, every part Bayesian, on the
full training split with ChEES-HMC, 4 short chains from 2 MAP starts, about 8 minutes for digits
on one CPU thread (``mcmc_preset``; ``--kernel nuts`` or ``hmc`` take 2 Pyro chains instead).
Options of the other inference method, of another MCMC kernel, and of another task, are
refused.

Exit status: 0 on success; 2 on bad arguments or input files, with one line on stderr starting
``probtransformer: error:``; 1 when the fit diverges (``NonFiniteELBOError``); 130 on Ctrl-C,
also when MCMC sampling was interrupted after its first kept draw and the run was written with
the draws so far (marked partial). A Ctrl-C after the fit, while the run is evaluated or
written, writes no run directory but keeps the fitted posterior in ``OUT.posterior`` (or the
first free ``OUT.posterior-2``, ...; ``inference.load_posterior`` loads it), as the error line
says.
"""

from probtransformer.cli._common import CLIError
from probtransformer.cli._main import main
from probtransformer.cli.options import mcmc_preset
from probtransformer.cli.parser import build_parser

__all__ = ["CLIError", "build_parser", "main", "mcmc_preset"]
