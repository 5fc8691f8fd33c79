"""What the server computes: a run's posterior predictive for merged requests, split per request.

``Service`` holds one run read back safely (``rundir.read_run``: nothing named by the run's
files is imported or executed) and answers ``/predict`` payloads already checked by
``parse_sequences``. It runs only on the batcher's worker thread.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probtransformer.inference.inputs import out_of_range_message
from probtransformer.inference.posterior.results import Prediction
from probtransformer.rundir import DIAGNOSTICS_FILE, Run
from probtransformer.serving.batcher import Abandoned
from probtransformer.tasks._base import table_scaling, training_range
from probtransformer.validation import int_text

#: Rows x draws of one model call (a 64-row digits pass at S=100 takes about 0.3 s on 2 cores):
#: a larger merged request runs as several calls, between which the worker checks that a client
#: still waits, and its activations stay small.
PASS_ROW_DRAWS = 64 * 100
#: Sets of draws the service keeps (the digits run's 100 draws take 13 MiB).
DRAWS_KEPT = 8

#: Units of every numeric field of a ``/predict`` row, by kind of prediction.
CATEGORICAL_UNITS = {
    "probs": "probability",
    "probs_interval": "probability (equal-tailed interval over posterior draws)",
    "entropy": "nats",
    "aleatoric": "nats",
    "epistemic": "nats",
    "attention": "probability (attention weight over keys)",
    "draws.probs": "probability",
}
REGRESSION_UNITS = {
    "mean": "target units",
    "std": "target units",
    "interval": "target units (equal-tailed predictive interval, noise included)",
    "aleatoric": "target units squared (variance)",
    "epistemic": "target units squared (variance)",
    "attention": "probability (attention weight over keys)",
    "draws.loc": "target units",
    "draws.variance": "target units squared (variance)",
    "draws.samples": "target units",
}


#: How to send sequences of several lengths in one request.
PAD_HINT = " (pad the sequences to one length and send a mask)"


class InvalidInput(ValueError):
    """A request field the model cannot take (HTTP 422).

    Attributes:
        loc: the field's path, e.g. ``("body", "sequences", 3)``.
    """

    def __init__(self, loc: tuple, message: str) -> None:
        super().__init__(message)
        self.loc = loc


@dataclasses.dataclass(frozen=True)
class PredictPayload:
    """One checked ``/predict`` request: ``x`` ``(n, T, F)`` or ``(n, T)``, ``mask`` or None."""

    x: torch.Tensor
    mask: torch.Tensor | None
    num_samples: int
    seed: int
    interval: float
    attention: bool
    abstain_above: float | None
    return_draws: bool

    def key(self, merges: bool) -> tuple:
        """Requests with equal keys share one pass: the same draws, flags and sequence length
        (and a mask or none). Without ``merges`` every request is its own key."""
        if not merges:
            return (id(self),)
        return (self.num_samples, self.seed, self.attention, self.x.shape[1:], self.mask is None)


class Service:
    """The served run.

    Args:
        run: the run directory read back.
        num_samples: draws of a request that does not say (``/predict``'s default).

    Attributes:
        task: the task of the model's class (``tasks.task_of``).
        tokens: the model reads token ids ``(N, T)`` (else features ``(N, T, F)``).
        categorical: predictions are class probabilities (else regression values).
        merges: concurrent requests may share a pass: checked at start on two training rows,
            a row's prediction is the same alone as next to another row (False when rows draw
            their own noise: regression samples, MC-dropout masks, stochastic attention).

    Raises:
        ValueError: the run's model does not read sequences (no ``max_len``).
    """

    def __init__(self, run: Run, *, num_samples: int) -> None:
        from probtransformer.tasks import task_of

        post = run.posterior
        model = post.model
        if not hasattr(model, "max_len"):
            raise ValueError(
                f"serve needs a run of a sequence model, got a {type(model).__name__} run"
            )
        self.run = run
        self.post = post
        self.model = model
        self.num_samples = num_samples
        self.task = task_of(model).name  # the model's class decides, not metrics.json
        self.tokens = getattr(model, "vocab_size", None) is not None
        self.vocab = getattr(model, "vocab", None)
        self.class_names = run.record.get("class_names")
        table = run.record.get("table") or {}  # fit --data: features arrive in the file's units
        self.table_features = table.get("features")
        self.scaling = None
        if table.get("x_loc") is not None and not self.tokens:
            self.scaling = (torch.tensor(table["x_loc"]), torch.tensor(table["x_scale"]))
        self.categorical, self.merges = self._probe()
        self.units = CATEGORICAL_UNITS if self.categorical else REGRESSION_UNITS
        self.diagnostics = _read_diagnostics(run.path / DIAGNOSTICS_FILE)
        self._draws: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()

    def _probe(self) -> tuple[bool, bool]:
        """``(categorical, merges)`` from two training rows, 4 draws: row 1 alone and after
        row 0 must give equal outputs (1e-6). Also keeps the sizes ``answer_bytes`` reads."""
        example = self.post.example
        rows = example[:2] if len(example) >= 2 else example[[0, 0]]
        both = self.post.predict(rows.x, rows.mask, num_samples=4, seed=0)
        alone = self.post.predict(
            rows.x[1:], None if rows.mask is None else rows.mask[1:], num_samples=4, seed=0
        )
        fields = ("probs",) if isinstance(both, Prediction) else ("samples", "loc", "variance")
        same = all(
            torch.allclose(getattr(both, f)[:, 1:], getattr(alone, f), atol=1e-6, rtol=0)
            for f in fields
        )
        out = getattr(both, fields[0])[0, 0]  # one row's prediction of one draw
        self._row_values = out.numel() // (rows.x.shape[1] if self.tokens else 1)
        weights = self.post.attention(
            rows.x[:1], None if rows.mask is None else rows.mask[:1], num_samples=1
        ).samples
        *_, layers, heads, queries, keys = weights.shape
        self._attention = (layers * heads, queries - rows.x.shape[1], keys - rows.x.shape[1])
        return isinstance(both, Prediction), same

    # -- requests -------------------------------------------------------------------------

    def parse(self, body: Any) -> PredictPayload:
        """A checked payload from a validated ``PredictRequest``.

        Raises:
            InvalidInput: sequences or mask the model cannot take, naming the field, what it
                expected and what arrived; ``abstain_above`` for a regression run.
        """
        x = parse_sequences(body.sequences, self.model, tokens=self.tokens)
        mask = None
        if body.mask is not None:
            mask = _array(body.mask, ("body", "mask"), "(N, T) booleans", kinds="b")
            mask = torch.from_numpy(mask)
        try:
            self.model.validate(x, None, mask)
        except (TypeError, ValueError) as e:
            message = str(e)
            field = "mask" if message.startswith("mask") else "sequences"
            if message.startswith("x "):
                message = "sequences " + message[2:]
            raise InvalidInput(("body", field), message) from None
        if self.scaling is not None:  # the run's training standardization, padding kept 0
            loc, scale = self.scaling
            real = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else mask
            x = torch.where(real[..., None], (x - loc) / scale, 0.0).to(x.dtype)
        if body.abstain_above is not None and not self.categorical:
            raise InvalidInput(
                ("body", "abstain_above"),
                f"abstain_above is an epistemic threshold in nats, for classification and "
                f"tagging runs; this is a {self.task} run (epistemic variance in target units "
                "squared): leave it out",
            )
        return PredictPayload(
            x=x,
            mask=mask,
            num_samples=self.num_samples if body.num_samples is None else body.num_samples,
            seed=body.seed,
            interval=body.interval,
            attention=body.attention,
            abstain_above=body.abstain_above,
            return_draws=body.return_draws,
        )

    def warnings(self, payload: PredictPayload) -> list[str]:
        """Input problems that do not stop the prediction (features of real steps far outside
        the training range)."""
        x = payload.x if payload.mask is None else payload.x[payload.mask]
        scaling = table_scaling(self.run.record) or {}  # fit --data: in the file's units
        message = out_of_range_message(x, self.post.record.get("x_range"), **scaling)
        return [] if message is None else [message]

    def answer_bytes(self, payload: PredictPayload) -> int:
        """About how many bytes of JSON the answer to ``payload`` holds (20 per number)."""
        rows, steps = payload.x.shape[:2]
        out = self._row_values * (steps if self.tokens else 1)
        values = 8 * out  # the summaries and the interval
        if payload.return_draws:
            values += payload.num_samples * out * (1 if self.categorical else 3)
        if payload.attention:
            pairs, extra_queries, extra_keys = self._attention
            values += 2 * pairs * (steps + extra_queries) * (steps + extra_keys)
        return 20 * rows * values

    def predict_batch(
        self, payloads: list[PredictPayload], abandoned: Callable[[], bool] = lambda: False
    ) -> list[list[dict]]:
        """The rows of each payload (which share draws and flags), from merged passes of at
        most ``PASS_ROW_DRAWS`` rows x draws (one pass when rows draw their own noise); every
        summary is per row, so a row's answer does not depend on its neighbours.

        Raises:
            Abandoned: ``abandoned()`` said yes between two passes (every client left).
        """
        first = payloads[0]
        x = torch.cat([p.x for p in payloads])
        mask = None if first.mask is None else torch.cat([p.mask for p in payloads])
        draws = self.draws(first.num_samples, first.seed)
        step = max(1, PASS_ROW_DRAWS // first.num_samples) if self.merges else len(x)
        masses = {p.interval for p in payloads}
        with_draws = any(p.return_draws for p in payloads)
        columns = collections.defaultdict(list)
        for lo in range(0, len(x), step):
            if abandoned():
                raise Abandoned(f"every client left before rows {lo}-{len(x) - 1} were computed")
            part = slice(lo, lo + step)
            chunk_mask = None if mask is None else mask[part]
            for key, values in self._pass(x[part], chunk_mask, first, draws, masses, with_draws):
                columns[key] += values
        labels = self.vocab if self.task == "language-modeling" else self.class_names
        interval = "probs_interval" if self.categorical else "interval"
        summaries = [key for key in columns if "." not in key]
        out, start = [], 0
        for payload in payloads:
            rows = []
            for i in range(start, start + payload.x.shape[0]):
                row = {key: columns[key][i] for key in summaries}
                row[interval] = {
                    "mass": payload.interval,
                    "lower": columns[f"lower.{payload.interval}"][i],
                    "upper": columns[f"upper.{payload.interval}"][i],
                }
                if labels is not None and "predicted" in row:
                    row["predicted_label"] = _labels(row["predicted"], labels)
                if payload.abstain_above is not None:
                    row["abstain"] = (np.asarray(row["epistemic"]) > payload.abstain_above).tolist()
                if payload.return_draws:
                    row["draws"] = {
                        key[6:]: columns[key][i] for key in columns if key.startswith("draws.")
                    }
                if first.attention:
                    row["attention"] = {
                        "mean": columns["attention.mean"][i],
                        "sd": columns["attention.sd"][i],
                    }
                rows.append(row)
            out.append(rows)
            start += payload.x.shape[0]
        return out

    def _pass(self, x, mask, first: PredictPayload, draws, masses: set[float], with_draws: bool):
        """One model call over ``x``: ``(name, per-row list)`` of the summaries,
        ``lower.<mass>``/``upper.<mass>``, ``draws.<field>`` (each row's values per draw) and
        ``attention.mean``/``attention.sd``."""
        pred = self.post.predict(x, mask, seed=first.seed, draws=draws)
        if isinstance(pred, Prediction):
            summaries = {"probs": pred.mean, "predicted": pred.predicted, "entropy": pred.entropy}
            per_draw, interval = {"probs": pred.probs}, pred.credible_interval
        else:
            summaries = {"mean": pred.mean, "std": pred.std}
            per_draw = {"loc": pred.loc, "variance": pred.variance, "samples": pred.samples}
            interval = pred.predictive_interval
        summaries |= {"aleatoric": pred.aleatoric, "epistemic": pred.epistemic}
        yield from ((key, value.tolist()) for key, value in summaries.items())
        for mass in masses:
            lower, upper = interval(mass)
            yield f"lower.{mass}", lower.tolist()
            yield f"upper.{mass}", upper.tolist()
        if with_draws:
            yield from ((f"draws.{k}", v.transpose(0, 1).tolist()) for k, v in per_draw.items())
        if first.attention:
            weights = self.post.attention(x, mask, seed=first.seed, draws=draws).samples
            weights = weights.flatten(0, 1)  # (S, N, layer, head, query, key)
            yield "attention.mean", weights.mean(0).tolist()
            yield "attention.sd", weights.std(0, correction=0).tolist()

    def draws(self, num_samples: int, seed: int):
        """``Posterior.draw(num_samples, seed=seed)``, kept for the ``DRAWS_KEPT`` most recent
        ``(num_samples, seed)``: drawing 100 guide draws of the digits run takes 43 ms, the
        1-row pass over them 12 ms."""
        key = (num_samples, seed)
        if key in self._draws:
            self._draws.move_to_end(key)
        else:
            self._draws[key] = self.post.draw(num_samples, seed=seed)
            if len(self._draws) > DRAWS_KEPT:
                self._draws.popitem(last=False)
        return self._draws[key]

    # -- metadata -------------------------------------------------------------------------

    def metadata(self) -> dict:
        """What ``GET /metadata`` reports about the run (limits are added by the app)."""
        model, record = self.model, self.run.record
        if self.tokens:
            shape = f"(N, T) int token ids in [0, {model.vocab_size}), T <= {model.max_len}"
        else:
            shape = f"(N, T, F={model.in_features}) floats, T <= {model.max_len}"
        fit = {
            key: value
            for key, value in record.items()
            if isinstance(value, str | int | float | bool) and key != "class_names"
        }
        return {
            "task": self.task,
            "model": type(model).__name__,
            "device": str(self.post.device),
            "input": {
                "kind": "tokens" if self.tokens else "features",
                "shape": shape,
                "max_len": model.max_len,
                "in_features": getattr(model, "in_features", None),
                "vocab_size": getattr(model, "vocab_size", None),
                "features": self.table_features,  # a fit --data run's columns, in order
                "standardized_by_server": self.scaling is not None,
            },
            "prediction": "categorical" if self.categorical else "regression",
            # each draw's likelihood, which the predictive interval mixes (Client.predict)
            "likelihood": None if self.categorical else _likelihood(model),
            "classes": self.class_names,
            "vocabulary": self.vocab,
            "training_range": None
            if self.tokens
            else training_range(self.post.record.get("x_range"), table_scaling(record)),
            "fit": fit,
            "diagnostics": self.diagnostics,
            "units": self.units,
        }


def _likelihood(model) -> dict:
    """``{"family", "df"}`` of a regression model's likelihood: ``"normal"`` (df None),
    ``"student_t"`` with its df, or family None for a model that does not say."""
    family = getattr(model, "likelihood", None)
    if family not in ("normal", "student_t"):
        return {"family": None, "df": None}
    return {"family": family, "df": float(model.df) if family == "student_t" else None}


def parse_sequences(sequences: list, model, *, tokens: bool) -> torch.Tensor:
    """``sequences`` (JSON arrays) as ``(N, T)`` int64 token ids or ``(N, T, F)`` float32.

    Raises:
        InvalidInput: ragged arrays, values that are not numbers (token ids: not integers).
    """
    loc = ("body", "sequences")
    if tokens:
        ids = [v for v in _leaves(sequences) if type(v) is int]  # in Python ints: beyond int64 too
        if ids and (min(ids) < 0 or max(ids) >= model.vocab_size):
            raise InvalidInput(
                loc,
                f"expected token ids in [0, {model.vocab_size}), got values in "
                f"[{int_text(min(ids))}, {int_text(max(ids))}]",
            )
        expected = f"(N, T) integer token ids, T <= {model.max_len}"
        array = _array(sequences, loc, expected, "iu", PAD_HINT)
        if array.ndim != 2:
            raise InvalidInput(loc, f"expected {expected}, got an array of shape {array.shape}")
        return torch.from_numpy(array.astype(np.int64))
    expected = f"(N, T, F={model.in_features}) numbers, T <= {model.max_len}"
    array = _array(sequences, loc, expected, "iuf", PAD_HINT)
    if array.ndim != 3:
        raise InvalidInput(loc, f"expected {expected}, got an array of shape {array.shape}")
    largest = np.abs(array).max()  # NaN and inf are named by the model's check
    if np.isfinite(largest) and largest > np.finfo(np.float32).max:
        raise InvalidInput(
            loc, f"expected numbers within float32's range (about ±3.4e38), got {largest:.3g}"
        )
    return torch.from_numpy(array.astype(np.float32))


def _array(value: list, loc: tuple, expected: str, kinds: str, hint: str = "") -> np.ndarray:
    """``value`` as a rectangular NumPy array whose dtype kind is one of ``kinds``."""
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError):  # ragged (NumPy >= 1.24 refuses them)
        array = np.asarray(value, dtype=object)
    if array.dtype == object:
        ragged = f"expected {expected} as a rectangular array, got ragged rows{hint}"
        accepted = {"int", "float"} | ({"true or false"} if "b" in kinds else set())
        others = {JSON_TYPES.get(type(v), type(v).__name__) for v in _leaves(value)} - accepted
        if others:
            raise InvalidInput(loc, f"expected {expected}, got {' and '.join(sorted(others))}")
        if "f" not in kinds:  # token ids or a mask: its values fit, its rows do not
            raise InvalidInput(loc, ragged)
        try:  # numbers only: integers beyond int64, or ragged rows
            array = np.asarray(value, dtype=np.float64)
        except OverflowError:
            raise InvalidInput(
                loc, f"expected {expected}, got an integer beyond float64's range"
            ) from None
        except ValueError:
            raise InvalidInput(loc, ragged) from None
    if array.size == 0:
        raise InvalidInput(loc, f"expected {expected}, got an empty array of shape {array.shape}")
    if array.dtype.kind in "iuf" and any(isinstance(v, bool) for v in _leaves(value)):
        raise InvalidInput(loc, f"expected {expected}, got true or false among the numbers")
    if array.dtype.kind not in kinds:
        names = {"b": "booleans", "U": "strings", "f": "floating-point numbers", "i": "integers"}
        got = names.get(array.dtype.kind, str(array.dtype))
        raise InvalidInput(loc, f"expected {expected}, got {got}")
    return array


#: How the values a JSON body can hold read in a message (by their Python types).
JSON_TYPES = {type(None): "null", dict: "objects", str: "strings", bool: "true or false"}


def _leaves(value: list):
    """The non-list items of nested lists, depth first."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        else:
            yield item


def _labels(index: int | list[int], labels: list[str]):
    """The label of class ``index`` (or the labels of a list of them: token-level rows)."""
    if isinstance(index, int):
        return labels[index]
    return [labels[i] for i in index]


def _read_diagnostics(path: Path) -> dict | None:
    """``ok``, ``verdict`` and ``warnings`` of the run's diagnostics.json, or None when the run
    has none; an unreadable file is reported, not raised."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {key: data[key] for key in ("ok", "verdict", "warnings")}
    except KeyError as e:
        problem = f"it lacks {e}"
    except (OSError, ValueError, TypeError) as e:
        problem = str(e)
    return {"ok": None, "verdict": [], "warnings": [f"unreadable {path}: {problem}"]}
