"""``Client`` against answers that are not a probtransformer server's (a proxy's page, another
API, a truncated answer), through httpx's mock transport: no server runs."""

import json
import math

import pytest
import torch

httpx = pytest.importorskip("httpx")

from probtransformer.client import Client, ServerError  # noqa: E402

METADATA = {"limits": {"max_request_rows": 4}}


def _client(answer) -> Client:
    """A client whose requests get ``answer(request) -> httpx.Response``."""
    client = Client("http://testserver")
    client._http = httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(answer))
    return client


def _predict_answer(rows):
    def answer(request):
        if request.url.path == "/metadata":
            return httpx.Response(200, json=METADATA)
        return httpx.Response(200, json={"rows": rows})

    return answer


def test_a_page_that_is_not_json_is_a_server_error_naming_the_url():
    client = _client(lambda request: httpx.Response(200, text="<html>proxy login</html>"))
    with pytest.raises(ServerError, match="http://testserver.*is the URL a probtransformer"):
        client.health()


def test_json_with_nan_is_refused():
    client = _client(lambda request: httpx.Response(200, text='{"status": NaN}'))
    with pytest.raises(ServerError, match="a bare NaN"):
        client.health()


@pytest.mark.parametrize(
    "rows, words",
    [
        (None, "no rows for 2 sequences"),
        ([{"draws": {"probs": [[0.5, 0.5]]}}], "1 rows for 2 sequences"),
        ([{"probs": [0.5, 0.5]}] * 2, "rows without draws"),
        ([{"draws": {"probs": [[0.5, 0.5]]}}, {"draws": {"probs": [[1.0]]}}], "do not stack"),
    ],
)
def test_predict_answers_that_do_not_fit_the_request_are_server_errors(rows, words):
    client = _client(_predict_answer(rows))
    with pytest.raises(ServerError, match=words):
        client.predict(torch.zeros(2, 3, 1), num_samples=1)


def test_a_well_formed_answer_gives_a_prediction():
    rows = [{"draws": {"probs": [[0.25, 0.75]]}}] * 2
    pred = _client(_predict_answer(rows)).predict(torch.zeros(2, 3, 1), num_samples=1)
    assert pred.probs.shape == (1, 2, 2)


@pytest.mark.parametrize(
    "likelihood, df, width",
    [
        ({"family": "normal", "df": None}, math.inf, 2 * 1.6448536),  # 90% of N(0, 1)
        ({"family": "student_t", "df": 4.0}, 4.0, 2 * 2.1318468 / math.sqrt(2)),  # sd 1
    ],
)
def test_a_regression_answer_mixes_the_likelihood_the_metadata_names(likelihood, df, width):
    """One draw of sd 1: the interval is that draw's likelihood's, not a sampled y's (zero)."""
    rows = [{"draws": {"samples": [[0.3]], "loc": [[0.0]], "variance": [[1.0]]}}]

    def answer(request):
        if request.url.path == "/metadata":
            return httpx.Response(200, json={**METADATA, "likelihood": likelihood})
        return httpx.Response(200, json={"rows": rows})

    pred = _client(answer).predict(torch.zeros(1, 3, 1), num_samples=1)
    assert pred.df == df
    lower, upper = pred.predictive_interval(0.9)
    assert float(upper[0] - lower[0]) == pytest.approx(width, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(url="127.0.0.1:8000"), "url must be http"),
        (dict(url="ftp://host"), "url must be http"),
        (dict(url="http://"), "url must be http"),
        (dict(url="http://127.0.0.1:99999"), r"port must lie in \[1, 65535\], got 99999"),
        (dict(timeout=-1), "timeout must be a positive number"),
        (dict(timeout=float("nan")), "timeout must be a positive number"),
        (dict(timeout="5"), "timeout must be a positive number"),
    ],
)
def test_bad_url_or_timeout_is_refused_when_the_client_is_made(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Client(**kwargs)


def test_generate_warns_about_prompt_characters_outside_the_vocabulary():
    events = (
        'event: token\ndata: {"index": 0, "token_id": 1, "token": "a", "entropy": 0.1, '
        '"aleatoric": 0.05, "epistemic": 0.05}\n\n'
        f"event: done\ndata: {json.dumps({'text': 'a', 'unknown': 2})}\n\n"
    )
    client = _client(lambda request: httpx.Response(200, text=events))
    with pytest.warns(UserWarning, match="2 prompt character"):
        steps = list(client.generate("??"))
    assert [step.token for step in steps] == ["a"]


def test_an_error_page_that_is_not_json_says_the_url_may_not_be_a_server():
    page = "<!DOCTYPE HTML><html>" + "x" * 500 + "</html>"

    def answer(request):
        return httpx.Response(404, text=page, headers={"content-type": "text/html"})

    with pytest.raises(
        ValueError,
        match=r"HTTP 404: Not Found, as a page of text/html .*is "
        r"http://testserver/ a probtransformer server\?",
    ) as error:
        _client(answer).health()
    assert "DOCTYPE" not in str(error.value)
    assert "(GET http://testserver/health)" in str(error.value)  # the path that was missing
