"""A Python client of ``probtransformer serve``: the same ``Prediction`` objects as
``Posterior.predict``, so notebook code runs unchanged against a server.

Example::

    from probtransformer.client import Client

    with Client("http://127.0.0.1:8000") as server:
        pred = server.predict(x, num_samples=100, seed=0)   # Prediction, draws included
        pred.epistemic                                       # (N,) nats

Needs httpx (the ``serve`` extra).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from probtransformer.inference.posterior.results import Prediction, RegressionPrediction
from probtransformer.models.generate import TokenStep, _warn_unknown


class ServerError(RuntimeError):
    """The server failed (HTTP 5xx), or answered with something that is not its API.

    Attributes:
        status: the HTTP status.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Client:
    """Talk to ``probtransformer serve`` at ``url``.

    Args:
        url: the server's base URL.
        api_key: sent as ``Authorization: Bearer <api_key>`` (servers started with
            ``--api-key-env``).
        timeout: seconds to wait for an answer.

    Errors of a request: ``ValueError`` for what the server refused (422, 413, 415, 404: its
    message names the field, what was expected and what arrived), ``PermissionError`` for 401,
    ``ServerError`` for 5xx, ``ConnectionError`` when the server cannot be reached,
    ``TimeoutError`` when it does not answer within ``timeout``.

    Raises:
        ImportError: httpx is missing.
        ValueError: a ``url`` that is not ``http(s)://host[:port][/path]``, a ``timeout`` that
            is not a positive number (or None: wait forever), or an ``api_key`` that no HTTP
            header can carry (empty, whitespace at its ends, control or non-ASCII characters).
    """

    def __init__(
        self, url: str = "http://127.0.0.1:8000", *, api_key: str | None = None, timeout=60.0
    ) -> None:
        try:
            import httpx
        except ImportError:
            raise ImportError(
                "the client needs httpx: pip install 'probtransformer[serve]'"
            ) from None
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as e:
            raise ValueError(f"url must be http(s)://host[:port], got {url!r}: {e}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"url must be http(s)://host[:port], got {url!r}")
        if parsed.port is not None and not 0 < parsed.port < 2**16:
            raise ValueError(f"url's port must lie in [1, 65535], got {parsed.port}")
        if timeout is not None and not (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and timeout > 0
            and math.isfinite(timeout)
        ):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        if api_key is not None and not _header_safe(api_key):
            raise ValueError(
                "api_key must be non-empty printable ASCII without whitespace at its ends"
            )
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout)
        self._httpx = httpx
        self._metadata: dict | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    # -- endpoints ------------------------------------------------------------------------

    def health(self) -> dict:
        """``GET /health``."""
        return self._request("GET", "/health")

    def metadata(self) -> dict:
        """``GET /metadata``: task, input shape, classes or vocabulary, training range, fit
        summary, diagnostics verdict, units and limits."""
        self._metadata = self._request("GET", "/metadata")
        return self._metadata

    def predict_rows(self, x, mask=None, **options: Any) -> dict:
        """``POST /predict`` as it answers (rows of JSON), for one request.

        Args:
            x: ``(N, T, F)`` features or ``(N, T)`` token ids (tensor, array or nested lists).
            mask: ``(N, T)`` bool, True = real step, or None.
            options: ``num_samples``, ``seed``, ``interval``, ``attention``, ``abstain_above``,
                ``return_draws`` (see the server's ``/docs``).
        """
        body = {"sequences": _as_list(x), **options}
        if mask is not None:
            body["mask"] = _as_list(mask)
        try:
            content = json.dumps(body, allow_nan=False)
        except ValueError:
            raise ValueError("x holds NaN or inf values, which JSON cannot carry") from None
        headers = {"Content-Type": "application/json"}
        return self._request("POST", "/predict", content=content, headers=headers)

    def predict(
        self, x, mask=None, *, num_samples: int = 100, seed: int = 0
    ) -> Prediction | RegressionPrediction:
        """The posterior predictive, as ``Posterior.predict`` returns it (draws included).

        Inputs of more rows than the server takes in one request are sent in pieces, each with
        the same draws (``seed``). Draws are not split: ``num_samples`` is at most the server's
        limit (``serving.limits.MAX_NUM_SAMPLES``, 1,000), beyond which the server answers 422
        and this raises ``ValueError``; more draws need the run loaded in Python.

        Returns:
            ``Prediction`` with ``probs (S, N, C)`` (``(S, N, T, C)`` for token models), or
            ``RegressionPrediction`` with ``samples``, ``loc``, ``variance`` ``(S, N, ...)`` and
            the ``df`` of the likelihood the server's metadata names.

        Raises:
            ValueError, PermissionError, ServerError, ConnectionError: see ``Client``.
        """
        limit = (self._metadata or self.metadata())["limits"]["max_request_rows"]
        n = len(x)
        if n == 0:
            raise ValueError("x must hold at least one sequence, got 0 rows")
        rows = []
        for start in range(0, n, limit):
            some = mask[start : start + limit] if mask is not None else None
            answer = self.predict_rows(
                x[start : start + limit],
                some,
                num_samples=num_samples,
                seed=seed,
                return_draws=True,
            )
            rows.extend(self._rows(answer, min(limit, n - start)))
        draws = [row["draws"] for row in rows]
        try:
            if "probs" in draws[0]:
                return Prediction(probs=_stack(draws, "probs"))
            return RegressionPrediction(
                samples=_stack(draws, "samples"),
                loc=_stack(draws, "loc"),
                variance=_stack(draws, "variance"),
                df=_likelihood_df((self._metadata or self.metadata()).get("likelihood")),
            )
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise self._not_ours(200, f"its draws do not stack: {type(e).__name__}: {e}") from None

    def generate(self, prompt: str | list[int], **options: Any) -> Iterator[TokenStep]:
        """``POST /generate``: the tokens after ``prompt`` as they are decoded, each a
        ``TokenStep`` (token, entropy, aleatoric and epistemic parts in nats).

        Args:
            prompt: text or token ids.
            options: ``max_new_tokens``, ``strategy``, ``temperature``, ``top_k``, ``top_p``,
                ``thompson``, ``num_samples``, ``seed``.

        Raises:
            ValueError, PermissionError, ServerError, ConnectionError: see ``Client``; a
            ``ServerError`` too when the generation fails midway.
        """
        body = {"prompt": _as_list(prompt), **options}
        with self._connected():
            with self._http.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    _raise_for(response)
                event = None
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        event = line[len("event: ") :]
                    elif line.startswith("data: "):
                        data = json.loads(line[len("data: ") :])
                        if event == "token":
                            yield TokenStep(**data)
                        elif event == "error":
                            raise ServerError(200, f"generation failed: {data['detail']}")
                        else:
                            _warn_unknown([data.get("unknown", 0)])  # as generate does
                            return

    # -- plumbing -------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs) -> Any:
        with self._connected():
            response = self._http.request(method, path, **kwargs)
        _raise_for(response)
        try:  # the server never sends NaN: JSON that holds one is someone else's
            return json.loads(response.text, parse_constant=_refuse_constant)
        except ValueError as e:
            raise self._not_ours(response.status_code, f"not its JSON ({e})") from None

    def _rows(self, answer: Any, expected: int) -> list[dict]:
        """The ``rows`` of a ``/predict`` answer, each with its ``draws``."""
        rows = answer.get("rows") if isinstance(answer, dict) else None
        if not isinstance(rows, list) or len(rows) != expected:
            got = "no rows" if not isinstance(rows, list) else f"{len(rows)} rows"
            raise self._not_ours(200, f"{got} for {expected} sequences")
        if not all(isinstance(row, dict) and isinstance(row.get("draws"), dict) for row in rows):
            raise self._not_ours(200, "rows without draws")
        return rows

    def _not_ours(self, status: int, what: str) -> ServerError:
        return ServerError(
            status,
            f"{self._http.base_url} answered in a way probtransformer serve does not: {what}; "
            "is the URL a probtransformer server's?",
        )

    @contextlib.contextmanager
    def _connected(self) -> Iterator[None]:
        """``ConnectionError`` (naming the URL) for a server that cannot be reached."""
        try:
            yield
        except self._httpx.TimeoutException as e:
            raise TimeoutError(f"no answer from {self._http.base_url} in time: {e}") from e
        except self._httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the server at {self._http.base_url}: {e}") from e


def _refuse_constant(name: str):
    raise ValueError(f"a bare {name}")


def _header_safe(key: str) -> bool:
    return bool(key) and key == key.strip() and key.isprintable() and key.isascii()


def _raise_for(response) -> None:
    status = response.status_code
    if status < 400:
        return
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):  # an HTML error page: someone else's server
        kind = response.headers.get("content-type", "no content type")
        detail = (
            f"{response.reason_phrase}, as a page of {kind} that probtransformer serve never "
            f"sends: is {response.request.url.copy_with(path='/', query=None)} a "
            "probtransformer server?"
        )
    if isinstance(detail, list):  # FastAPI's 422 list: field, message, what arrived
        detail = "; ".join(
            f"{'.'.join(map(str, item.get('loc', [])))}: {item.get('msg')}"
            + (f" (got {item['input']!r})" if "input" in item else "")
            for item in detail
        )
    if status == 404:  # a path this server lacks: a base URL with a path of its own, say
        detail = f"{detail} ({response.request.method} {response.request.url})"
    message = f"HTTP {status}: {detail}"
    if status == 401:
        raise PermissionError(message)
    if status < 500:
        raise ValueError(message)
    raise ServerError(status, message)


def _as_list(value) -> list:
    """Tensors and arrays as nested lists (float32 values exactly, as Python floats)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _stack(draws: list[dict], name: str) -> torch.Tensor:
    """``(S, N, ...)`` float32 from each row's ``(S, ...)`` draws of ``name``."""
    return torch.stack([torch.tensor(row[name], dtype=torch.float32) for row in draws], 1)


def _likelihood_df(likelihood: dict | None) -> float | None:
    """``RegressionPrediction.df`` from the metadata's ``likelihood``: inf for a Normal, the
    Student-t's df, None for another family (or a server that does not say)."""
    family = (likelihood or {}).get("family")
    if family == "normal":
        return math.inf
    if family == "student_t":
        return float(likelihood["df"])
    return None
