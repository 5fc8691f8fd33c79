"""The HTTP app of ``probtransformer serve``: FastAPI endpoints over a ``Service``.

Endpoints: ``POST /predict``, ``POST /generate`` (server-sent events, language-model runs),
``GET /health``, ``GET /metadata``; OpenAPI at ``/docs`` and ``/redoc``, which load nothing
from the internet. Malformed requests get 422 with
FastAPI's error list (``loc`` names the field, ``msg`` what was expected and what arrived,
``input`` what arrived); requests over the size limits get 413; with an API key, requests
without ``Authorization: Bearer <key>`` get 401 (``/health`` and the docs stay open).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import threading
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPBearer
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from probtransformer.serving.batcher import MicroBatcher
from probtransformer.serving.limits import MAX_NEW_TOKENS, MAX_NUM_SAMPLES, SEED_MAX, Limits
from probtransformer.serving.service import InvalidInput, Service

#: Where the app serves the Swagger UI and ReDoc scripts of /docs and /redoc.
DOCS_ASSETS = "/docs-assets"

# -- request and response schemas ---------------------------------------------------------------

NumSamples = Annotated[
    StrictInt | None,
    Field(ge=1, le=MAX_NUM_SAMPLES, description="posterior draws S (default: the server's)"),
]
Seed = Annotated[
    StrictInt, Field(ge=0, le=SEED_MAX, description="seeds the draws; same seed, same answer")
]


class PredictRequest(BaseModel):
    """``POST /predict``: the posterior predictive of N sequences."""

    model_config = ConfigDict(extra="forbid")

    sequences: list[list[Any]] = Field(
        min_length=1,
        description="N sequences of one length T <= max_len: (N, T, F) numbers (features) or "
        "(N, T) int token ids, as GET /metadata's input.shape says",
    )
    mask: list[list[Any]] | None = Field(
        None, description="(N, T) booleans, true = real step (default: every step real)"
    )
    num_samples: NumSamples = None
    seed: Seed = 0
    interval: float = Field(
        0.9,
        gt=0,
        lt=1,
        strict=True,
        allow_inf_nan=False,
        description="probability mass of the equal-tailed intervals, in (0, 1)",
    )
    attention: StrictBool = Field(
        False, description="add the posterior mean and sd of each row's attention weights"
    )
    abstain_above: float | None = Field(
        None,
        ge=0,
        strict=True,
        allow_inf_nan=False,
        description="epistemic threshold in nats: rows (steps) above it get abstain=true "
        "(classification and tagging runs)",
    )
    return_draws: StrictBool = Field(False, description="add each posterior draw's prediction")


class PredictResponse(BaseModel):
    """``/predict``'s answer (the row fields depend on the run; ``units`` names them)."""

    task: str = Field(description="the run's task")
    num_samples: int = Field(description="posterior draws S the answer used (count)")
    seed: int
    units: dict[str, str] = Field(description="the unit of every numeric row field")
    warnings: list[str] = Field(description="input problems that did not stop the prediction")
    rows: list[dict[str, Any]] = Field(
        description="one per sequence. Classification and tagging: probs (probability), "
        "predicted (class index), predicted_label, entropy, aleatoric, epistemic (nats), "
        "probs_interval {mass, lower, upper} (probability), abstain (when asked); tagging and "
        "language models give each per step. Regression and forecasting: mean, std (target "
        "units), aleatoric, epistemic (variances, target units squared), interval {mass, lower, "
        "upper} (target units). attention {mean, sd} (layer, head, query, key) and draws "
        "(per-draw probs, or loc, variance and samples) when asked."
    )


class GenerateRequest(BaseModel):
    """``POST /generate``: continue a prompt with a language-model run (server-sent events)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[StrictInt] = Field(
        min_length=1, description="text (read character by character) or token ids"
    )
    max_new_tokens: StrictInt = Field(100, ge=1, le=MAX_NEW_TOKENS, description="tokens K")
    strategy: Literal["greedy", "sample"] = "greedy"
    temperature: float = Field(
        1.0, gt=0, strict=True, allow_inf_nan=False, description="> 0, unitless"
    )
    top_k: StrictInt | None = Field(None, ge=1, description="keep the k most probable tokens")
    top_p: float | None = Field(
        None, gt=0, le=1, strict=True, allow_inf_nan=False, description="nucleus mass, in (0, 1]"
    )
    thompson: StrictBool = Field(
        False, description="decode with one posterior draw (else the posterior average)"
    )
    num_samples: NumSamples = None
    seed: Seed = 0


#: FastAPI's 400 for a body it could not read (too deep, numbers too long, not UTF-8).
UNPARSED_BODY = "There was an error parsing the body"
#: Seconds between checks that the client of a queued request is still there.
DISCONNECT_POLL_SECONDS = 0.1


async def _json_body(request: Request) -> None:  # async: no thread-pool hop per request
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise HTTPException(
            415,
            f"send the body as JSON with the header 'Content-Type: application/json', got "
            f"{kind or 'no Content-Type'}",
        )


JSON_BODY = Depends(_json_body)


# -- the app ---------------------------------------------------------------------------------


def create_app(service: Service, limits: Limits | None = None, *, api_key: str | None = None):
    """The FastAPI app serving ``service`` under ``limits``.

    Args:
        service: the run to serve.
        limits: batching and size limits (default: ``Limits()``).
        api_key: when set, every endpoint but ``/health`` and the docs needs
            ``Authorization: Bearer <api_key>`` (401 otherwise).
    """
    limits = Limits() if limits is None else limits
    merges = service.merges and limits.max_batch_rows > 1
    batcher = MicroBatcher(
        service.predict_batch,
        max_rows=limits.max_batch_rows,
        max_wait=limits.max_wait_ms / 1000,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await batcher.stop()  # after the server has drained its connections

    # FastAPI's /docs and /redoc load Swagger UI and ReDoc from a CDN (a blank page offline):
    # FastAPIOffline serves the copies its package ships, under DOCS_ASSETS
    app = FastAPIOffline(
        static_url=DOCS_ASSETS,
        title="probtransformer",
        summary=f"Uncertainty-aware predictions of a {service.task} run",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    # the key is checked by APIKey, added last so it runs first (before any body is read); the
    # dependency only declares the scheme in the OpenAPI schema, for /docs' "Authorize"
    keyed = []
    if api_key is not None:
        app.add_middleware(APIKey, key=api_key)
        keyed = [Depends(HTTPBearer(auto_error=False))]

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        if error.status_code == 400 and error.detail == UNPARSED_BODY:  # FastAPI's own
            cause = error.__cause__
            # without Python's advice to the operator on a number over 4,300 digits
            reason = str(cause).split("; use sys.set_int_max_str_digits")[0]
            if isinstance(cause, RecursionError):
                reason = "arrays nested too deeply"
            detail = [
                {
                    "type": "json_invalid",
                    "loc": ["body"],
                    "msg": "the body is not JSON that this server can read: "
                    f"{type(cause).__name__}: {reason}",
                }
            ]
            return JSONResponse({"detail": detail}, 422)
        return await http_exception_handler(request, error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        detail = [{**item, "input": _echo(item.get("input"))} for item in error.errors()]
        return JSONResponse({"detail": jsonable_encoder(detail, exclude={"ctx"})}, 422)

    @app.exception_handler(InvalidInput)
    async def invalid_input(request: Request, error: InvalidInput):
        detail = [{"type": "value_error", "loc": list(error.loc), "msg": str(error)}]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health() -> dict:
        """``{"status": "ok"}`` while the server takes requests."""
        return {"status": "ok"}

    @app.get("/metadata", dependencies=keyed)
    @app.head("/metadata", dependencies=keyed, include_in_schema=False)
    async def metadata() -> dict:
        """The run: task, input shape, classes or vocabulary, training range, fit summary,
        diagnostics verdict, units, and the server's limits and batching."""
        return {
            **service.metadata(),
            "limits": {
                "max_request_rows": limits.max_request_rows,
                "max_body_bytes": limits.max_body_bytes,
                "max_response_bytes": limits.max_response_bytes,
                "max_num_samples": MAX_NUM_SAMPLES,
                "max_new_tokens": MAX_NEW_TOKENS,
                "default_num_samples": service.num_samples,
            },
            "batching": {
                "max_batch_rows": limits.max_batch_rows,
                "max_wait_ms": limits.max_wait_ms,
                "merges_requests": merges,
                "passes": batcher.batches,
            },
        }

    @app.post("/predict", response_model=PredictResponse, dependencies=[*keyed, JSON_BODY])
    async def predict(body: PredictRequest, request: Request):
        """Posterior predictive of each sequence, with its uncertainty (see the schema)."""
        rows = len(body.sequences)
        if rows > limits.max_request_rows:
            raise HTTPException(
                413,
                f"sequences holds {rows} rows; this server takes at most "
                f"{limits.max_request_rows} per request (split the request)",
            )
        payload = service.parse(body)
        size = service.answer_bytes(payload)
        if size > limits.max_response_bytes:
            raise HTTPException(
                413,
                f"the answer would hold about {size / 2**20:.3g} MiB of JSON; this server sends "
                f"at most {limits.max_response_bytes / 2**20:.3g} MiB: ask for fewer rows, "
                "fewer draws, or no draws or attention",
            )
        key = payload.key(merges)
        answer = asyncio.ensure_future(batcher.submit(key, payload, rows))
        try:
            while not answer.done():  # a request whose client left is dropped from the queue
                await asyncio.wait({answer}, timeout=DISCONNECT_POLL_SECONDS)
                if not answer.done() and await request.is_disconnected():
                    answer.cancel()
                    raise HTTPException(499, "the client went away")
        except asyncio.CancelledError:  # a forced shutdown (a second Ctrl-C) cancels the wait
            answer.cancel()
            return JSONResponse(
                {"detail": "the server stopped before answering; send the request again"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        try:
            out = answer.result()
        except (TypeError, ValueError) as e:  # the model refused the input
            raise InvalidInput(("body", "sequences"), str(e)) from None
        return JSONResponse(
            {
                "task": service.task,
                "num_samples": payload.num_samples,
                "seed": payload.seed,
                "units": service.units,
                "warnings": service.warnings(payload),
                "rows": out,
            }
        )

    @app.post("/generate", dependencies=[*keyed, JSON_BODY])
    async def generate(body: GenerateRequest, request: Request):
        """Text after ``prompt``, streamed as server-sent events: one ``token`` event per new
        token (``index``, ``token_id``, ``token``, and ``entropy``, ``aleatoric``,
        ``epistemic`` in nats), then ``done`` (``text``, ``unknown``: prompt characters mapped
        to ``<unk>``), or ``error``. A generation runs on the model worker as one job, between
        ``/predict`` passes: predictions that arrive meanwhile wait and batch together."""
        from probtransformer.models import CausalLM, generate_stream
        from probtransformer.models.generate import prompt_ids

        if not isinstance(service.model, CausalLM):
            raise HTTPException(
                404, f"/generate serves language-model runs; this is a {service.task} run"
            )
        try:
            ids, unknown = prompt_ids(service.model, body.prompt)
        except (TypeError, ValueError) as e:
            raise InvalidInput(("body", "prompt"), str(e)) from None
        options = dict(
            max_new_tokens=body.max_new_tokens,
            strategy=body.strategy,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            bayes_average=not body.thompson,
            num_samples=service.num_samples if body.num_samples is None else body.num_samples,
            seed=body.seed,
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def job() -> None:  # on the worker: decode, handing each token to the event loop
            try:
                text = []
                for step in generate_stream(service.post, ids, **options):
                    if stop.is_set():
                        break
                    text.append(step.token or "")
                    loop.call_soon_threadsafe(
                        events.put_nowait, ("token", dataclasses.asdict(step))
                    )
                done = {"text": "".join(text) if service.model.vocab else None, "unknown": unknown}
                loop.call_soon_threadsafe(events.put_nowait, ("done", done))
            except Exception as e:  # reported to the client as an error event
                loop.call_soon_threadsafe(events.put_nowait, ("error", {"detail": str(e)}))

        async def stream():
            finished = asyncio.ensure_future(batcher.run_on_worker(job))
            try:
                while True:
                    kind, data = await events.get()
                    yield f"event: {kind}\ndata: {json.dumps(data)}\n\n"
                    if kind != "token":
                        break
            finally:
                stop.set()  # the client went away: stop decoding at the next token
                del finished  # the job ends on the worker by itself

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def _echo(value: Any, limit: int = 200) -> Any:
    """What arrived, for a 422: JSON-safe (NaN and infinities as text) and at most ``limit``
    characters of JSON (a whole array of sequences is not sent back)."""
    text = json.dumps(value, default=str)  # NaN, Infinity: not JSON
    if len(text) > limit:
        return text[:limit] + "..."
    return text if any(word in text for word in ("NaN", "Infinity")) else value


class APIKey:
    """ASGI middleware: 401 for an HTTP request without ``Authorization: Bearer <key>``, before
    anything reads its body (so an unauthorised client learns nothing about the body it sent).
    ``/health`` and the docs stay open."""

    OPEN = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
    MESSAGE = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = key.encode()

    def _open(self, path: str) -> bool:
        """``path`` needs no key: ``/health``, the docs pages and their scripts."""
        return path in self.OPEN or path.startswith(f"{DOCS_ASSETS}/")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self._open(scope["path"]):
            await self.app(scope, receive, send)
            return
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            {"detail": self.MESSAGE}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``limit`` bytes (by its Content-Length, or
    counted while it arrives)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_large(send, int(length))
            return
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self._message(received))
            return message

        await self.app(scope, counted, send)

    def _message(self, size: int) -> str:
        return f"the request body holds {size} bytes or more; this server takes {self.limit}"

    async def _too_large(self, send, size: int) -> None:
        body = json.dumps({"detail": self._message(size)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
