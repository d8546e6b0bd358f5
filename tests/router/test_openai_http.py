"""The OpenAI-compatible HTTP API (`--http-port`) against the fake scheduler, through the
official `openai` client: shapes, streaming, n > 1, stop strings, errors, API keys, aborts."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from services.router.api_keys import format_line, new_key
from tests.conftest import free_port
from tests.router.utils import ANSWER, RouterProcess, wait_until

KEY = new_key()
MODEL = "tiny-chat"  # the fixture model directory's name


@pytest.fixture(scope="module")
def http_router(scheduler_server, tiny_model_dir, tmp_path_factory):
    """A router serving HTTP too, with one API key (tenant "team-a")."""
    workdir = tmp_path_factory.mktemp("http-router")
    keys = workdir / "keys.txt"
    keys.write_text(format_line(KEY, "alice", "team-a", 0) + "\n")
    port, metrics_port = free_port(), free_port()
    proc = RouterProcess(
        scheduler_server.address,
        tiny_model_dir,
        *("--http-port", str(port), "--api-key-file", str(keys)),
        *("--metrics-port", str(metrics_port), "--max-message-bytes", "65536"),
        log=workdir / "router.log",
    ).wait_serving()
    proc.http = f"http://127.0.0.1:{port}"
    proc.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    yield proc
    proc.stop()


@pytest.fixture()
def client(http_router) -> openai.OpenAI:
    with openai.OpenAI(
        base_url=f"{http_router.http}/v1", api_key=KEY, max_retries=0, timeout=30
    ) as c:
        yield c


def get(url: str, key: str | None = None, data: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET, or of a POST of `data`."""
    request = urllib.request.Request(url, data=data)
    if data is not None:
        request.add_header("content-type", "application/json")
    if key is not None:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_completion_text_usage_and_submit(fake, client, tiny_tokenizer):
    result = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=200)
    choice = result.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == (ANSWER, "stop", 0)
    prompt_ids = tiny_tokenizer.encode("Say hi")
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == len(fake.answer_ids)
    assert result.usage.total_tokens == len(prompt_ids) + len(fake.answer_ids)
    assert result.object == "text_completion" and result.model == MODEL
    sent = fake.submits[-1]
    assert list(sent.prompt_token_ids) == prompt_ids
    assert (sent.tenant, sent.principal) == ("team-a", "alice")  # the key's, as over gRPC


def test_http_completion_passes_sampling_fields(fake, client):
    client.completions.create(
        model=MODEL,
        prompt=[1, 2, 3],
        max_tokens=4,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "ignore_eos": True,
            "min_tokens": 2,
        },
    )
    sent = fake.submits[-1]
    assert list(sent.prompt_token_ids) == [1, 2, 3]
    s = sent.sampling
    assert (s.max_tokens, s.top_k, s.seed, s.ignore_eos, s.min_tokens) == (4, 5, 7, True, 2)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.min_p == pytest.approx(0.1) and s.repetition_penalty == pytest.approx(1.2)
    assert s.presence_penalty == pytest.approx(0.5)
    assert s.frequency_penalty == pytest.approx(0.25)


def test_http_completion_stream_with_usage(fake, client):
    stream = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len(chunks) > 5  # streamed, not one message
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(fake.answer_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_http_system_fingerprint_is_the_weight_version(fake, client):
    # Before any UpdateWeights: version 0, the weights loaded from --model.
    result = client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert result.system_fingerprint == "weights-v0"
    fake.reset(weight_version=3)
    result = client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert result.system_fingerprint == "weights-v3"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.system_fingerprint == "weights-v3"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks and {c.system_fingerprint for c in chunks} == {"weights-v3"}


def test_http_chat_n_choices_stream_and_seeds(fake, client, tiny_tokenizer):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=8,
        n=3,
        seed=10,
        stream=True,
    )
    texts, roles, finishes = {}, {}, {}
    for chunk in stream:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles.setdefault(choice.index, choice.delta.role)
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    expected = tiny_tokenizer.decode(fake.answer_ids[:8])
    assert texts == {0: expected, 1: expected, 2: expected}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert sorted(s.sampling.seed for s in fake.submits) == [10, 11, 12]
    rendered = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    prompt_ids = tiny_tokenizer.encode(rendered, add_special_tokens=False)
    assert all(list(s.prompt_token_ids) == prompt_ids for s in fake.submits)


def test_http_chat_default_max_tokens_fills_the_context(fake, client, tiny_tokenizer):
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}]
    )
    assert result.choices[0].message.content == ANSWER
    assert result.choices[0].message.role == "assistant"
    num_prompt = result.usage.prompt_tokens
    assert fake.submits[-1].sampling.max_tokens == 256 - num_prompt


def test_http_prompt_list_counts_each_prompt_once(fake, client):
    result = client.completions.create(model=MODEL, prompt=["a", "b c"], max_tokens=3, n=2)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.completion_tokens == 4 * 3
    prompts = [len(s.prompt_token_ids) for s in fake.submits]
    assert result.usage.prompt_tokens == sum(sorted(prompts)[::2])


def test_http_stop_string_ends_choice_and_aborts(fake, client):
    result = client.completions.create(model=MODEL, prompt="x", max_tokens=200, stop=["brown fox"])
    assert result.choices[0].text == ANSWER[: ANSWER.index("brown fox")]
    assert result.choices[0].finish_reason == "stop"
    submitted = fake.submits[-1].request_id
    wait_until(lambda: submitted in fake.aborts, what="abort after the stop string")


def test_http_client_disconnect_aborts(fake, client):
    fake.reset(mode="endless", delay_s=0.01)
    stream = client.completions.create(
        model=MODEL, prompt="x", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    submitted = fake.submits[-1].request_id
    wait_until(lambda: submitted in fake.aborts, what="abort after the client went away")


def test_http_client_disconnect_before_the_answer_aborts(fake, http_router):
    fake.reset(mode="endless", delay_s=0.01)
    impatient = openai.OpenAI(
        base_url=f"{http_router.http}/v1", api_key=KEY, max_retries=0, timeout=0.5
    )
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=MODEL, prompt="x", max_tokens=200, extra_body={"ignore_eos": True}
        )
    wait_until(lambda: fake.submits, what="the submission")
    submitted = fake.submits[-1].request_id
    wait_until(lambda: submitted in fake.aborts, what="abort after the client went away")
    # A hang-up is the client's doing: no traceback per hang-up to flood the log with.
    assert "Traceback" not in http_router.log.read_text()


def test_http_errors_in_openai_shape(fake, client, http_router):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="unsupported parameter.*logit_bias"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"1": 5})
    with pytest.raises(openai.BadRequestError, match=r"min_tokens=3 .* max_tokens=2"):
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"min_tokens": 3}
        )
    with pytest.raises(openai.BadRequestError, match="temperature=200.0 is out of range"):
        client.completions.create(model=MODEL, prompt="x", temperature=200)
    with pytest.raises(openai.BadRequestError, match="max_tokens") as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "bot", "content": "x"}])
    bad = openai.OpenAI(base_url=f"{http_router.http}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.PermissionDeniedError, match="team-a"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"tenant": "team-b"})
    assert not fake.submits  # nothing refused reached the scheduler


def test_http_two_authorization_headers_are_refused(http_router):
    """Which of two credentials counts would be a guess (the first won silently)."""
    host, port = http_router.http.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("GET", "/v1/models")
    connection.putheader("authorization", f"Bearer {KEY}")
    connection.putheader("authorization", "Bearer someone-else")
    connection.endheaders()
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    assert response.status == 401 and "one `authorization`" in body["error"]["message"]


def test_http_malformed_requests_get_openai_errors(fake, http_router):
    url = f"{http_router.http}/v1/completions"
    status, body = get(url, KEY, b'{"prompt": "x", ')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in body["error"]["message"] and body["error"]["param"] is None
    status, body = get(url, KEY, json.dumps({"prompt": "x", "n": 0}).encode())
    assert status == 400 and body["error"]["param"] == "n"
    for field, value in (("temperature", -1), ("top_p", 0), ("seed", -1)):  # the core's checks
        status, body = get(url, KEY, json.dumps({"prompt": "x", field: value}).encode())
        assert status == 400 and body["error"]["param"] == field, body
    status, body = get(url, KEY, json.dumps({"model": MODEL}).encode())
    assert status == 400 and "prompt" in body["error"]["message"]
    status, body = get(url, KEY, json.dumps({"prompt": "x" * 100_000}).encode())
    assert status == 413 and "--max-message-bytes" in body["error"]["message"]
    assert post_chunked(http_router.http, json.dumps({"prompt": "x" * 100_000}).encode()) == 413
    status, body = get(url, KEY, json.dumps({"prompt": ["x"] * 65}).encode())
    assert status == 400 and "--max-stream-requests" in body["error"]["message"]
    status, body = get(f"{http_router.http}/v2/nothing", KEY)
    assert status == 404 and body["error"]["message"]
    # JSON's escape of a lone surrogate (no encoding can hold it; the tokenizer raised: 500)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi \\ud800"}]}
    for path, sent, param in (
        ("/v1/completions", {"prompt": "\\ud800"}, "prompt"),
        ("/v1/chat/completions", chat, "messages[0].content"),
        ("/tokenize", {"prompt": "a \\udfff"}, "prompt"),
    ):
        raw = json.dumps(sent).replace("\\\\", "\\").encode()  # the escape itself, once
        status, body = get(f"{http_router.http}{path}", KEY, raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["param"] == param and "lone surrogate" in body["error"]["message"]
    assert not fake.submits


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    """(status, JSON body) of a POST of `body` with exactly these headers."""
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_bodies_a_client_gets_wrong_are_named(fake, http_router):
    """The usual mistakes get a message that says what to fix, not pydantic's or FastAPI's
    generic one; a value of the wrong JSON type is refused, never coerced."""
    url, auth = f"{http_router.http}/v1/completions", {"authorization": f"Bearer {KEY}"}
    sent = json.dumps({"prompt": "x", "max_tokens": 3}).encode()
    for headers in ({}, {"content-type": "application/x-www-form-urlencoded"}):  # curl -d
        status, body = post(url, sent, auth | headers)
        assert status == 415 and "Content-Type: application/json" in body["error"]["message"]
    json_type = auth | {"content-type": "application/json"}
    status, body = post(url, b'{"prompt": "\xff x"}', json_type)
    assert status == 400 and "not valid UTF-8 (byte 12)" in body["error"]["message"], body
    status, body = post(url, b"[" * 20_000 + b"]" * 20_000, json_type)
    assert status == 400 and "nests too deeply" in body["error"]["message"], body
    for field, value in (("max_tokens", True), ("max_tokens", "5"), ("stream", "false")):
        status, body = post(url, json.dumps({"prompt": "x", field: value}).encode(), json_type)
        assert status == 400 and body["error"]["param"] == field, body
    status, body = post(
        url, json.dumps({"prompt": "x", "temperature": 0}).encode(), json_type
    )  # an integer is a number
    assert status == 200, body
    assert get(f"{http_router.http}/openapi.json")[0] == 401  # the schema needs a key too
    status, schema = get(f"{http_router.http}/openapi.json", KEY)
    assert status == 200 and "/v1/completions" in schema["paths"]
    assert len(fake.submits) == 1


def post_chunked(base_url: str, body: bytes) -> int:
    """The status of a POST /v1/completions whose body has no Content-Length (chunked)."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        chunks = (body[i : i + 8192] for i in range(0, len(body), 8192))
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        connection.request("POST", "/v1/completions", chunks, headers, encode_chunked=True)
        return connection.getresponse().status
    finally:
        connection.close()


def test_http_port_taken_stops_the_router(scheduler_server, tiny_model_dir, http_router):
    taken = http_router.http.rsplit(":", 1)[1]
    proc = RouterProcess(scheduler_server.address, tiny_model_dir, "--http-port", taken)
    assert proc.proc.wait(timeout=60) == 2  # a configuration error, before serving anything


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, openai.RateLimitError),
        (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_http_scheduler_refusals_get_their_status(fake, client, mode, error, stream):
    fake.reset(mode=mode)
    with pytest.raises(error) as info:
        client.completions.create(model=MODEL, prompt="x", stream=stream)
    assert info.value.status_code == (429 if error is openai.RateLimitError else 503)


def test_http_tokenize_as_vllm(http_router, tiny_tokenizer):
    status, body = get(f"{http_router.http}/tokenize", KEY, json.dumps({"prompt": "Hi"}).encode())
    assert status == 200
    assert body == {
        "tokens": tiny_tokenizer.encode("Hi"),
        "count": len(tiny_tokenizer.encode("Hi")),
        "max_model_len": 256,
    }


def test_http_models_health_version_and_metrics(client, http_router, scheduler_server):
    (model,) = client.models.list().data
    assert (model.id, model.owned_by) == (MODEL, "conveyor")
    assert get(f"{http_router.http}/version")[1]["version"]
    assert get(f"{http_router.http}/health") == (200, {"status": "ok"})
    assert get(f"{http_router.http}/v1/models")[0] == 401  # no key
    scheduler_server.set_serving(False)
    try:
        wait_until(lambda: get(f"{http_router.http}/health")[0] == 503, what="health 503")
    finally:
        scheduler_server.set_serving(True)
    wait_until(lambda: get(f"{http_router.http}/health")[0] == 200, what="health 200")
    with urllib.request.urlopen(http_router.metrics, timeout=30) as response:
        metrics = response.read().decode()
    assert 'conveyor:http_requests_total{endpoint="/v1/models",status="401"}' in metrics
    assert 'conveyor:http_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert "conveyor:request_success_total" in metrics  # the core's metrics cover HTTP too
