"""``probtransformer serve`` as a user meets it: the real server in a subprocess on a free port,
small saved runs (the fixtures of ``tests/fixtures``), HTTP through httpx and the Python client.

One digits server (with an API key and small limits) and one language-model server are shared
by the module; the drain tests start their own.
"""

import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from probtransformer.cli import main  # noqa: E402
from probtransformer.client import Client  # noqa: E402
from probtransformer.datasets import load  # noqa: E402
from probtransformer.models import generate  # noqa: E402
from probtransformer.rundir import read_run, write_diagnostics  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
KEY = "s3cret-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
MAX_ROWS = 16  # --max-request-rows of the digits server
MAX_BODY = 65536  # --max-body-bytes of the digits server
MAX_ANSWER = 200_000  # --max-response-bytes of the digits server
T, F = 8, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``probtransformer serve`` subprocess, up once ``/health`` answers."""

    def __init__(self, run_dir: Path, *options: str, env: dict | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "probtransformer.cli", "serve", str(run_dir)]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port), *options],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not start within 90 s")

    def stop(self, sig=signal.SIGTERM) -> str:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            out, _ = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return out


@pytest.fixture(scope="module")
def digits():
    return load("digits")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, digits) -> Path:
    """The saved tiny digits run, with the diagnostics.json fit writes today."""
    run_dir = tmp_path_factory.mktemp("digits") / "run"
    shutil.copytree(FIXTURES / "main-0fadaf9" / "run", run_dir)
    post = read_run(run_dir).posterior
    write_diagnostics(run_dir / "diagnostics.json", post, digits.train[:60], {"num_samples": 10})
    return run_dir


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A run directory around the saved tiny character language model."""
    run_dir = tmp_path_factory.mktemp("lm") / "run"
    shutil.copytree(FIXTURES / "text-83eafce" / "CausalLM", run_dir / "posterior")
    record = {"task": "language-modeling", "dataset": "pydoc-text", "seed": 0}
    (run_dir / "metrics.json").write_text(json.dumps(record))
    return run_dir


@pytest.fixture(scope="module")
def server(digits_run):
    """Digits, with an API key, small limits and a 50 ms batching window."""
    options = ["--api-key-env", "PT_TEST_KEY", "--max-request-rows", str(MAX_ROWS)]
    options += ["--max-body-bytes", str(MAX_BODY), "--max-wait-ms", "50"]
    options += ["--max-response-bytes", str(MAX_ANSWER)]
    server = Server(digits_run, *options, env={"PT_TEST_KEY": KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lm_server(lm_run):
    server = Server(lm_run)
    yield server
    server.stop()


def _post(server, body, path="/predict", **kwargs):
    kwargs.setdefault("headers", HEADERS)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


def _still_serving(server) -> None:
    answer = _post(server, {"sequences": [[[0.0] * F] * T], "num_samples": 2})
    assert answer.status_code == 200, answer.text


# -- endpoints ---------------------------------------------------------------------------------


def test_health_metadata_and_docs(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    meta = httpx.get(f"{server.url}/metadata", headers=HEADERS).json()
    assert meta["task"] == "classification" and meta["model"] == "SequenceClassifier"
    assert meta["device"] == "cpu"
    assert meta["input"]["kind"] == "features" and meta["input"]["max_len"] == T
    assert meta["classes"] == [str(c) for c in range(10)]
    assert meta["training_range"] == [0.0, 1.0]
    assert meta["fit"]["inference"] == "svi" and meta["fit"]["num_train"] == 60
    assert isinstance(meta["diagnostics"]["ok"], bool) and meta["diagnostics"]["verdict"]
    assert meta["limits"]["max_request_rows"] == MAX_ROWS
    assert meta["batching"]["merges_requests"] is True
    assert meta["units"]["epistemic"] == "nats"
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/predict", "/generate", "/health", "/metadata"} <= set(schema["paths"])
    fields = schema["components"]["schemas"]["PredictRequest"]["properties"]
    assert "nats" in fields["abstain_above"]["description"]
    assert httpx.get(f"{server.url}/docs").status_code == 200
    assert httpx.head(f"{server.url}/health").status_code == 200
    assert httpx.head(f"{server.url}/metadata", headers=HEADERS).status_code == 200
    assert httpx.head(f"{server.url}/metadata").status_code == 401
    operations = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(operations) == len(set(operations))


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_nothing_from_the_internet(server, page):
    html = httpx.get(f"{server.url}{page}").text  # open without the API key
    assert not re.findall(r"(?:https?:)?//[\w.-]+\.\w+", html)  # no CDN, no fonts, no favicon
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    assert any(a.endswith(".js") for a in assets)  # the page's UI, from the server itself
    for asset in assets:
        answer = httpx.get(f"{server.url}{asset}")
        assert answer.status_code == 200 and answer.content, asset


def test_predict_rows_match_the_posterior(server, digits_run, digits):
    x = digits.test.x[:3]
    body = {"sequences": x.tolist(), "num_samples": 8, "seed": 5, "interval": 0.8}
    body |= {"attention": True, "abstain_above": 0.0, "return_draws": True}
    answer = _post(server, body).json()
    post = read_run(digits_run).posterior
    pred = post.predict(x, num_samples=8, seed=5)
    attention = post.attention(x, num_samples=8, seed=5)
    lower, upper = pred.credible_interval(0.8)
    assert answer["num_samples"] == 8 and answer["warnings"] == []
    assert len(answer["rows"]) == 3
    for i, row in enumerate(answer["rows"]):
        assert torch.allclose(torch.tensor(row["probs"]), pred.mean[i], atol=1e-6)
        assert row["predicted"] == int(pred.predicted[i])
        assert row["predicted_label"] == str(int(pred.predicted[i]))
        for name in ("entropy", "aleatoric", "epistemic"):
            assert row[name] == pytest.approx(float(getattr(pred, name)[i]), abs=1e-6)
        assert row["abstain"] == (float(pred.epistemic[i]) > 0.0)
        assert torch.allclose(torch.tensor(row["probs_interval"]["lower"]), lower[i], atol=1e-6)
        assert torch.allclose(torch.tensor(row["probs_interval"]["upper"]), upper[i], atol=1e-6)
        assert torch.equal(torch.tensor(row["draws"]["probs"]), pred.probs[:, i])
        mean = torch.tensor(row["attention"]["mean"])  # (layer, head, query, key)
        assert torch.allclose(mean, attention.mean()[i], atol=1e-6)
        assert torch.allclose(torch.tensor(row["attention"]["sd"]), attention.std()[i], atol=1e-6)


def test_a_large_request_runs_in_parts_that_equal_one_pass_and_stops_when_its_clients_leave(
    digits_run, digits, monkeypatch
):
    """Rows x draws over ``PASS_ROW_DRAWS`` run as several passes (here one row each); the
    answer is the one pass's, and ``abandoned()`` is checked before every pass."""
    import probtransformer.serving.service as service_module
    from probtransformer.serving import Service
    from probtransformer.serving.batcher import Abandoned

    service = Service(read_run(digits_run), num_samples=8)
    body = dict(num_samples=8, seed=5, interval=0.8, attention=True, abstain_above=0.0)
    payloads = [
        service.parse(SimpleNamespace(sequences=digits.test.x[lo:hi].tolist(), mask=None,
                                      return_draws=True, **body))
        for lo, hi in ((0, 2), (2, 5))
    ]  # fmt: skip
    whole = service.predict_batch(payloads)
    checks = []
    monkeypatch.setattr(service_module, "PASS_ROW_DRAWS", 8)
    parts = service.predict_batch(payloads, lambda: checks.append(1) and False)
    assert len(checks) == 5  # one pass per row
    assert [len(rows) for rows in parts] == [2, 3]
    assert all(_close(*pair) for pair in zip(sum(parts, []), sum(whole, []), strict=True))
    with pytest.raises(Abandoned, match="every client left"):
        service.predict_batch(payloads, lambda: True)


def _close(a, b) -> bool:
    """JSON values equal, their numbers within 1e-6."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, str | bool):
        return a == b
    return np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), atol=1e-6, rtol=0)


def test_client_refuses_empty_and_non_finite_inputs(server):
    with Client(server.url, api_key=KEY) as client:
        with pytest.raises(ValueError, match="at least one sequence"):
            client.predict(torch.zeros(0, T, F))
        with pytest.raises(ValueError, match="NaN or inf"):
            client.predict(torch.full((1, T, F), float("nan")))
    with pytest.raises(ValueError, match="api_key"):
        Client(server.url, api_key="k3y\n")


def test_client_prediction_equals_posterior_predict(server, digits_run, digits):
    x = digits.test.x[: MAX_ROWS + 4]  # over the request limit: sent in two pieces
    with Client(server.url, api_key=KEY) as client:
        served = client.predict(x, num_samples=6, seed=2)
    expected = read_run(digits_run).posterior.predict(x, num_samples=6, seed=2)
    assert served.probs.shape == expected.probs.shape == (6, len(x), 10)
    assert torch.allclose(served.probs, expected.probs, atol=1e-6, rtol=0)


def test_out_of_range_features_are_warned_about(server):
    answer = _post(server, {"sequences": [[[50.0] * F] * T], "num_samples": 2}).json()
    assert "preprocessed as in training" in answer["warnings"][0]
    beyond_int64 = _post(server, {"sequences": [[[10**20] * F] * T], "num_samples": 2})
    as_float = _post(server, {"sequences": [[[1e20] * F] * T], "num_samples": 2})
    assert beyond_int64.json() == as_float.json()  # the integer is read as the float it equals


def test_concurrent_requests_merge_and_each_equals_its_answer_alone(server, digits):
    bodies = [
        {"sequences": digits.test.x[i : i + 1 + i % 3].tolist(), "num_samples": 5, "seed": 1}
        for i in range(12)
    ]
    bodies += [{**bodies[0], "seed": 2}]  # other draws: its own pass
    passes = httpx.get(f"{server.url}/metadata", headers=HEADERS).json()["batching"]["passes"]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: _post(server, b).json(), bodies))
    merged = httpx.get(f"{server.url}/metadata", headers=HEADERS).json()["batching"]["passes"]
    assert merged - passes < len(bodies)  # some requests shared a pass
    for body, answer in zip(bodies, together, strict=True):
        alone = _post(server, body).json()
        for row, expected in zip(answer["rows"], alone["rows"], strict=True):
            assert torch.allclose(
                torch.tensor(row["probs"]), torch.tensor(expected["probs"]), atol=1e-6, rtol=0
            )
            assert row["epistemic"] == pytest.approx(expected["epistemic"], abs=1e-6)


# -- bad input -------------------------------------------------------------------------------

ROW = [[0.5] * F] * T


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"sequences": [[0.5] * F]}, "sequences", "expected (N, T, F=8)"),
        ({"sequences": [[[0.5] * 7] * T]}, "sequences", "F=8 features"),
        ({"sequences": [[[0.5] * F] * (T + 1)]}, "sequences", "max_len=8"),
        ({"sequences": [ROW, ROW[:4]]}, "sequences", "ragged"),
        ({"sequences": [[["a"] * F] * T]}, "sequences", "strings"),
        ({"sequences": [ROW], "mask": [[True] * 3]}, "mask", "shape (N, T)=(1, 8)"),
        ({"sequences": [ROW], "mask": [[False] * T]}, "mask", "at least one real step"),
        ({"sequences": [ROW], "mask": [[1] * T]}, "mask", "booleans, got integers"),
        ({"sequences": [ROW], "mask": [[True] * T, [True]]}, "mask", "ragged"),
        ({"sequences": [[[1e300] * F] * T]}, "sequences", "float32's range"),
        ({"sequences": [[[10**400] * F] * T]}, "sequences", "integer beyond float64's range"),
        ({"sequences": [[[None] + [0.5] * (F - 1)] * T]}, "sequences", "got null"),
        ({"sequences": [ROW], "mask": [[True] * (T - 1) + [None]]}, "mask", "got null"),
        ({"sequences": [[[True] + [0.5] * (F - 1)] * T]}, "sequences", "true or false among"),
        ({"sequences": [ROW], "interval": "0.9"}, "interval", "valid number"),
        ({"sequences": [ROW], "abstain_above": True}, "abstain_above", "valid number"),
        ({"sequences": [ROW], "num_samples": 0}, "num_samples", "greater than or equal to 1"),
        ({"sequences": [ROW], "num_samples": 5000}, "num_samples", "less than or equal to 1000"),
        ({"sequences": [ROW], "num_samples": 2.5}, "num_samples", "valid integer"),
        ({"sequences": [ROW], "interval": 1.5}, "interval", "less than 1"),
        ({"sequences": [ROW], "seed": -1}, "seed", "greater than or equal to 0"),
        ({"sequences": [ROW], "num_sample": 3}, "num_sample", "Extra inputs"),
        ({"sequences": []}, "sequences", "at least 1 item"),
    ],
)
def test_malformed_requests_get_422_naming_the_field(server, body, field, words):
    answer = _post(server, body)
    assert answer.status_code == 422, answer.text
    (error,) = answer.json()["detail"][:1]
    assert field in error["loc"], error
    assert words in error["msg"], error
    _still_serving(server)


def test_bad_json_and_nan_get_422(server):
    headers = {**HEADERS, "Content-Type": "application/json"}
    bad = httpx.post(
        f"{server.url}/predict", content=b'{"sequences": [', headers=headers, timeout=10
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["type"] == "json_invalid"
    row = json.dumps([[[float("nan")] * F] * T])  # Python's json writes NaN
    content = ('{"sequences": ' + row + "}").encode()
    nan = httpx.post(f"{server.url}/predict", content=content, headers=headers, timeout=10)
    assert nan.status_code == 422 and "NaN or inf" in nan.json()["detail"][0]["msg"]
    long_number = b'{"sequences": [[[1' + b"1" * 5000 + b"]]]}"  # beyond Python's int digits
    long = httpx.post(f"{server.url}/predict", content=long_number, headers=headers, timeout=10)
    assert long.status_code == 422 and "not JSON that this server can read" in long.text
    assert "has 5001 digits" in long.text and "set_int_max_str_digits" not in long.text
    deep = b'{"sequences": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    nested = httpx.post(f"{server.url}/predict", content=deep, headers=headers, timeout=10)
    assert nested.status_code == 422 and "arrays nested too deeply" in nested.text
    plain = httpx.post(f"{server.url}/predict", content=b"{}", headers=HEADERS, timeout=10)
    assert plain.status_code == 415 and "Content-Type: application/json" in plain.text
    _still_serving(server)


def test_abstain_above_must_be_finite(server):
    content = b'{"sequences": [[[0.5]]], "abstain_above": Infinity}'
    headers = {**HEADERS, "Content-Type": "application/json"}
    answer = httpx.post(f"{server.url}/predict", content=content, headers=headers, timeout=10)
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][-1] == "abstain_above"


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory) -> Path:
    """A tiny forecasting-style run: a SequenceRegressor on a noisy sine, 20 SVI steps."""
    from probtransformer.datasets import SequenceData
    from probtransformer.inference import fit_svi
    from probtransformer.models import SequenceRegressor

    t = torch.arange(40.0)[:, None] + torch.arange(6.0)
    x, y = torch.sin(t / 3)[:, :, None], torch.sin((t[:, -1] + 1) / 3)
    model = SequenceRegressor(1, 6, d_model=8, num_heads=2, num_layers=1, d_ff=16)
    post = fit_svi(model, SequenceData(x, y), num_steps=20, progress=False)
    run_dir = tmp_path_factory.mktemp("regression") / "run"
    post.save(run_dir / "posterior")
    (run_dir / "metrics.json").write_text(json.dumps({"task": "os.system"}))  # not read
    return run_dir


@pytest.mark.filterwarnings("ignore:Using `httpx`")
def test_regression_runs_answer_alone_with_their_own_noise(regression_run):
    """Each row draws its own predictive samples, so requests are not merged (the start-up
    probe finds it); the answers are Posterior.predict's, intervals and draws included."""
    from fastapi.testclient import TestClient

    from probtransformer.serving import Service, create_app

    service = Service(read_run(regression_run), num_samples=10)
    assert not service.merges and not service.categorical
    x = torch.sin(torch.arange(12.0).reshape(2, 6, 1))
    with TestClient(create_app(service)) as client:
        body = {"sequences": x.tolist(), "seed": 4, "interval": 0.5, "return_draws": True}
        answer = client.post("/predict", json=body).json()
        refused = client.post("/predict", json={**body, "abstain_above": 0.1})
    pred = read_run(regression_run).posterior.predict(x, num_samples=10, seed=4)
    lower, upper = pred.predictive_interval(0.5)
    assert answer["task"] == "forecasting"  # from the model's class
    assert answer["units"]["epistemic"] == "target units squared (variance)"
    for i, row in enumerate(answer["rows"]):
        assert row["mean"] == pytest.approx(float(pred.mean[i]), abs=1e-6)
        assert row["epistemic"] == pytest.approx(float(pred.epistemic[i]), abs=1e-6)
        assert row["interval"]["lower"] == pytest.approx(float(lower[i]), abs=1e-6)
        assert row["interval"]["upper"] == pytest.approx(float(upper[i]), abs=1e-6)
        assert torch.equal(torch.tensor(row["draws"]["samples"]), pred.samples[:, i])
    assert refused.status_code == 422 and "forecasting run" in refused.json()["detail"][0]["msg"]


# -- auth and limits ---------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"X-Key": KEY}])
def test_a_missing_or_wrong_key_gets_401(server, headers):
    answer = _post(server, {"sequences": [ROW]}, headers=headers)
    assert answer.status_code == 401
    assert httpx.get(f"{server.url}/metadata", headers=headers).status_code == 401
    with pytest.raises(PermissionError, match="401"):
        Client(server.url, api_key=headers.get("Authorization", "x")[7:] or None).metadata()
    # the key is checked before the body is read: a malformed or oversized body gets 401 too
    for body in (b"{not json", b"[" * (MAX_BODY + 1)):
        kind = {"Content-Type": "application/json"}
        answer = httpx.post(f"{server.url}/predict", content=body, headers={**headers, **kind})
        assert answer.status_code == 401, answer.text


def test_the_key_scheme_is_case_insensitive_and_the_docs_stay_open(server):
    lower_case = {"Authorization": f"bearer {KEY}"}
    assert _post(server, {"sequences": [ROW]}, headers=lower_case).is_success
    assert httpx.get(f"{server.url}/openapi.json").json()["components"]["securitySchemes"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_over_the_row_or_body_limit_gets_413(server):
    rows = _post(server, {"sequences": [ROW] * (MAX_ROWS + 1)})
    assert rows.status_code == 413 and f"at most {MAX_ROWS}" in rows.json()["detail"]
    body = _post(server, {"sequences": [ROW] * 400})  # about 130 kB, Content-Length set
    assert body.status_code == 413 and str(MAX_BODY) in body.json()["detail"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"sequences": ['
        for _ in range(200):
            yield json.dumps(ROW).encode() + b","
        yield json.dumps(ROW).encode() + b"]}"

    chunked = httpx.post(f"{server.url}/predict", content=chunks(), headers=HEADERS, timeout=10)
    assert chunked.status_code == 413
    answer = _post(server, {"sequences": [ROW] * 8, "num_samples": 1000, "return_draws": True})
    assert answer.status_code == 413 and "fewer draws" in answer.json()["detail"]
    assert f"at most {MAX_ANSWER / 2**20:.3g} MiB" in answer.json()["detail"]  # not "0 MiB"
    _still_serving(server)


# -- generation ----------------------------------------------------------------------------------


def _events(response) -> list[tuple[str, dict]]:
    events, kind = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[6:])))
    return events


def test_generate_streams_the_tokens_of_generate(lm_server, lm_run):
    body = {"prompt": "def f(x", "max_new_tokens": 6, "num_samples": 4, "seed": 3}
    answer = httpx.post(f"{lm_server.url}/generate", json=body, timeout=60)
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = _events(answer)
    assert [kind for kind, _ in events] == ["token"] * 6 + ["done"]
    expected = generate(
        read_run(lm_run).posterior, "def f(x", max_new_tokens=6, num_samples=4, seed=3
    )
    tokens = [data for kind, data in events if kind == "token"]
    assert [t["token_id"] for t in tokens] == expected.token_ids.tolist()
    assert events[-1][1]["text"] == expected.text
    for name in ("entropy", "aleatoric", "epistemic"):
        got = torch.tensor([t[name] for t in tokens])
        assert torch.allclose(got, getattr(expected, name), atol=1e-6)
    streamed = list(
        Client(lm_server.url).generate("def f(x", max_new_tokens=6, num_samples=4, seed=3)
    )
    assert "".join(step.token for step in streamed) == expected.text


def test_token_requests_are_checked_against_the_vocabulary(lm_server, lm_run):
    vocab_size = read_run(lm_run).posterior.model.vocab_size
    outside = _post(lm_server, {"sequences": [[0, vocab_size]]}, headers={})
    assert outside.status_code == 422
    assert f"token ids in [0, {vocab_size})" in outside.json()["detail"][0]["msg"]
    for ids in ([[0, 10**22]], [[2**63, 1]]):  # beyond int64, and what numpy reads as uint64
        huge = _post(lm_server, {"sequences": ids}, headers={})
        assert huge.status_code == 422
        assert f"got values in [{min(ids[0])}, {max(ids[0])}]" in huge.json()["detail"][0]["msg"]
    huge = _post(lm_server, {"sequences": [[10**4000, 1]]}, headers={}).json()["detail"][0]
    assert huge["msg"].endswith("got values in [1, about 10^4000]")  # not its 4,001 digits
    empty = _post(lm_server, {"sequences": [[]]}, headers={})
    assert "got an empty array of shape (1, 0)" in empty.json()["detail"][0]["msg"]
    floats = _post(lm_server, {"sequences": [[0.0, 1.5]]}, headers={})
    assert floats.status_code == 422 and "got floating-point" in floats.json()["detail"][0]["msg"]
    prompt = httpx.post(f"{lm_server.url}/generate", json={"prompt": [vocab_size]}, timeout=10)
    assert prompt.status_code == 422 and prompt.json()["detail"][0]["loc"] == ["body", "prompt"]
    text = httpx.post(f"{lm_server.url}/generate", json={"prompt": "a", "temperature": "1"})
    assert text.status_code == 422 and text.json()["detail"][0]["loc"] == ["body", "temperature"]
    ok = _post(lm_server, {"sequences": [[1, 2, 3]], "num_samples": 2}, headers={}).json()
    assert len(ok["rows"][0]["probs"]) == 3  # one distribution per step
    assert len(ok["rows"][0]["predicted_label"]) == 3


def test_generate_on_a_classification_run_is_404(server):
    answer = _post(server, {"prompt": "abc"}, path="/generate")
    assert answer.status_code == 404 and "language-model runs" in answer.json()["detail"]


# -- safety ----------------------------------------------------------------------------------


def test_a_crafted_run_executes_nothing_and_refuses_to_start(tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "main-0fadaf9" / "run", run_dir)
    marker = tmp_path / "pwned"
    meta_file = run_dir / "posterior" / "posterior.json"
    meta = json.loads(meta_file.read_text())
    meta |= {"model_class": "os.system", "config": {"command": f"touch {marker}"}}
    meta_file.write_text(json.dumps(meta))
    assert main(["serve", str(run_dir), "--port", str(_free_port())]) == 2
    assert not marker.exists()
    assert "not a registered model class" in capsys.readouterr().err


def test_a_port_in_use_is_refused_in_one_line_before_the_run_loads(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        missing = tmp_path / "no-run"  # not read: the port is checked first
        assert main(["serve", str(missing), "--port", port]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in err
    assert main(["serve", str(missing), "--host", "no-such-host.invalid"]) == 2
    assert "--host no-such-host.invalid: not an address of this machine" in capsys.readouterr().err


@pytest.mark.parametrize(
    "key, words",
    [(None, "unset or empty"), ("", "unset or empty"), (" k3y", "whitespace"), ("sécret", "ASCII")],
)
def test_an_unusable_api_key_refuses_to_start(digits_run, capsys, monkeypatch, key, words):
    monkeypatch.delenv("PT_KEY", raising=False)
    if key is not None:
        monkeypatch.setenv("PT_KEY", key)
    assert main(["serve", str(digits_run), "--api-key-env", "PT_KEY"]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, words",
    [
        ("--port=70000", "in [1, 65535]"),
        ("--num-samples=5000", "in [1, 1000]"),
        ("--max-wait-ms=1e9", "in [0, 1000]"),
        ("--host=", "must name an address"),
        pytest.param(
            "--device=cuda",
            "CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
    ],
)
def test_out_of_range_options_are_refused(digits_run, capsys, option, words):
    assert main(["serve", str(digits_run), option]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_drains_the_requests_in_flight(digits_run, digits, sig):
    """A request waiting in its 1-second batching window when the signal arrives is answered;
    then the server exits."""
    server = Server(digits_run, "--max-wait-ms", "1000")
    body = {"sequences": digits.test.x[:2].tolist(), "num_samples": 3}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, server, body, headers={})
        time.sleep(0.4)
        output = server.stop(sig)
        answer = pending.result()
    assert answer.status_code == 200 and len(answer.json()["rows"]) == 2
    assert server.process.returncode is not None
    assert "Shutting down" in output


def test_a_second_ctrl_c_answers_the_requests_it_cuts_off_with_503(digits_run, digits):
    """A forced stop drops what is in flight, with a 503 the client can retry, not a 500."""
    server = Server(digits_run, "--max-wait-ms", "1000")
    body = {"sequences": digits.test.x[:2].tolist(), "num_samples": 3}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pool.submit(_post, server, body, headers={})  # a lone request: runs at once
        time.sleep(0.05)
        pending = pool.submit(_post, server, body, headers={})
        time.sleep(0.4)  # the second is in its 1-second batching window
        server.process.send_signal(signal.SIGINT)
        time.sleep(0.1)
        output = server.stop(signal.SIGINT)
        answer = pending.result()
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1" and "send the request again" in answer.text
    assert server.process.returncode == 130  # uvicorn may return rather than raise: still 130
    assert "answered 503 with Retry-After" in output
    assert "Traceback" not in output
