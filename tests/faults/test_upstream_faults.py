"""vLLM answers badly: 429/503 storms, slow replies, resets, malformed or truncated bodies, replies
with no score. The fake runs as a subprocess; a raw TCP server sends what no HTTP stack would.
Every episode ends in a score or an explicit error code, and /metrics accounts for every call."""

from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest

from tests.conftest import QWEN_REPLY
from tests.fakes.processes import completion, http_bytes, metric_sum, metrics, wait_circuits_closed
from tests.faults.common import EPISODE, one_backend, outcome, patient

GOOD = http_bytes(200, json.dumps(completion(QWEN_REPLY)).encode())


def _post(proxy, payload=EPISODE) -> httpx.Response:
    with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:  # 60 s: the hang guard
        return http.post("/score", json=payload)


async def _storm(proxy, fake, actions: list[dict], clients: int = 20) -> tuple[list[str], dict]:
    fake.script(*actions)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60, trust_env=False) as http:
        responses = await asyncio.wait_for(
            asyncio.gather(*(http.post("/score", json=EPISODE) for _ in range(clients))), 60)
    outcomes = [outcome(r) for r in responses]
    assert set(outcomes) <= {"ok", "upstream_unavailable"}
    assert all(r.json()["error"]["attempts"] <= 4 for r in responses if r.status_code == 503)
    values = metrics(None, proxy.url)
    ok, failed = outcomes.count("ok"), outcomes.count("upstream_unavailable")
    print("storm:", {"ok": ok, "upstream_unavailable": failed, "upstream calls": fake.chat_count()})
    # every call that reached vLLM is counted once, by result; every episode once, by outcome
    assert metric_sum(values, "vlm_proxy_upstream_calls_total") == fake.chat_count()
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result="ok") == ok
    assert metric_sum(values, "vlm_proxy_requests_total", route="/score", outcome="ok") == ok
    assert metric_sum(values, "vlm_proxy_requests_total", route="/score", outcome="upstream_unavailable") == failed
    assert metric_sum(values, "vlm_proxy_in_flight") == 0
    return outcomes, values


async def test_storm_of_429s_under_concurrency(fake_proc, proxy_thread, media_root):
    """429 is back-pressure: retried, never trips the circuit, every refusal is consumed and counted."""
    fake = fake_proc()
    proxy = proxy_thread(one_backend([fake.base_url], media_root))
    outcomes, values = await _storm(proxy, fake, [{"status": 429, "retry_after": 0}] * 60)
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result="upstream_unavailable") == 60
    assert fake.chat_count() == 60 + outcomes.count("ok")
    assert metric_sum(values, "vlm_proxy_circuit_open") == 0


async def test_storm_of_503s_opens_the_circuit_and_recovers(fake_proc, proxy_thread, media_root):
    """Consecutive 5xx take the replica out of rotation: the rest fail fast, explicitly; once the
    storm is over the readiness probe brings it back."""
    fake = fake_proc()
    proxy = proxy_thread(one_backend([fake.base_url], media_root))
    outcomes, _ = await _storm(proxy, fake, [{"status": 503}] * 60)
    assert outcomes.count("upstream_unavailable") >= 1
    fake.reset()  # the storm ends
    await asyncio.to_thread(wait_circuits_closed, proxy.url)
    assert outcome(_post(proxy)) == "ok"


def test_429_with_an_hour_of_retry_after_is_bounded_by_the_deadline(fake_proc, proxy_thread, media_root):
    fake = fake_proc()
    proxy = proxy_thread(one_backend([fake.base_url], media_root,
                                     retry={"attempts": 4, "backoff_s": [0.5, 5.0], "deadline_s": 2.0}))
    fake.script(*[{"status": 429, "retry_after": 3600}] * 4)
    response = _post(proxy)
    # it sleeps out the rest of the deadline, then reports the deadline: explicit, if not the 429
    assert outcome(response) in {"upstream_unavailable", "upstream_timeout"}
    # and the deadline, not the Retry-After nor the 4 attempts, ended it: the 429s were not all used
    assert response.json()["error"]["attempts"] < 4 and fake.chat_count() < 4
    assert http_ok_after(proxy, fake)


def http_ok_after(proxy, fake) -> bool:
    fake.reset()
    patient(proxy)  # the 2 s deadline above is the behaviour under test; this success must not race it
    return outcome(_post(proxy)) == "ok"


def test_slow_replies_past_the_timeout(fake_proc, proxy_thread, media_root):
    fake = fake_proc()
    # A reply that never comes, then one that does: the retry's timeout is long enough that a loaded
    # machine still answers within it (its length is never the point here, only that it ends the try).
    patient = proxy_thread(one_backend([fake.base_url], media_root,
                                       retry={"attempts": 3, "timeout_s": 3.0, "deadline_s": 30}))
    fake.script({"hang_s": 3600})
    response = _post(patient)
    assert outcome(response) == "ok" and response.json()["attempts"] == 2
    # No try answered: how many tries a short timeout allows depends on nothing but the count.
    proxy = proxy_thread(one_backend([fake.base_url], media_root,
                                     retry={"attempts": 3, "timeout_s": 0.3, "deadline_s": 30}))
    fake.script(*[{"hang_s": 3600}] * 3)
    response = _post(proxy)
    # each try ended by timeout_s (three of them), not by the deadline (it would have been one)
    assert outcome(response) == "upstream_timeout" and response.json()["error"]["attempts"] == 3
    values = metrics(None, proxy.url)
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result="upstream_timeout") == 3
    assert metric_sum(values, "vlm_proxy_requests_total", route="/score", outcome="upstream_timeout") == 1
    assert metric_sum(metrics(None, patient.url), "vlm_proxy_upstream_calls_total", result="upstream_timeout") == 1


def test_the_deadline_cuts_a_long_retry_budget(fake_proc, proxy_thread, media_root):
    fake = fake_proc()
    proxy = proxy_thread(one_backend([fake.base_url], media_root,
                                     retry={"attempts": 20, "timeout_s": 0.4, "deadline_s": 1.0},
                                     ))
    fake.script(*[{"hang_s": 3600}] * 20)  # no try answered while the test runs
    response = _post(proxy)
    assert outcome(response) == "upstream_timeout"
    # the deadline ended the retries: most of the 20 tries were never made
    assert response.json()["error"]["attempts"] < 20 and fake.chat_count() < 20


@pytest.mark.parametrize(("fault", "code"), [
    ({"malformed": True}, "upstream_bad_response"),
    ({"truncated": True}, "upstream_unavailable"),  # body shorter than Content-Length: a transport error
    ({"drop": True}, "upstream_unavailable"),
    ({"status": 500}, "upstream_unavailable"),
])
def test_broken_replies_every_time_end_in_an_explicit_error(fake_proc, proxy_thread, media_root, tmp_path,
                                                             fault, code):
    fake = fake_proc()
    audit = tmp_path / "audit.jsonl"
    proxy = proxy_thread(one_backend([fake.base_url], media_root, audit_log=str(audit)))
    fake.script(*[fault] * 4)
    response = _post(proxy)
    assert outcome(response) == code and response.json()["error"]["attempts"] == 4
    assert fake.chat_count() == 4
    values = metrics(None, proxy.url)
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result=code) == 4
    assert metric_sum(values, "vlm_proxy_requests_total", route="/score", outcome=code) == 1
    proxy.flush_audit()
    assert json.loads(audit.read_text())["error"]["code"] == code
    assert outcome(_post(proxy)) == "ok"  # and the next episode is fine


def test_mixed_faults_then_a_good_reply_is_a_score(fake_proc, proxy_thread, media_root):
    fake = fake_proc()
    proxy = proxy_thread(one_backend([fake.base_url], media_root, retry={"attempts": 5}))
    fake.script({"malformed": True}, {"truncated": True}, {"drop": True}, {"status": 429})
    response = _post(proxy)
    assert outcome(response) == "ok" and response.json()["attempts"] == 5


@pytest.mark.parametrize(("reply", "finish_reason"), [
    ("", "stop"),
    ("I cannot tell from this video.", "stop"),
    ("<think>the bowl is 80% of the way, 3/4 steps</think>", "stop"),
    ("<think>step 1 of 2 done, so 50", "length"),
    ("<score></score>", "stop"),
    ("<score>150</score>", "stop"),
    ("somewhere between 30 and 40", "stop"),
])
def test_a_reply_without_a_score_is_unparseable_never_zero(fake_proc, proxy_thread, media_root, tmp_path,
                                                          reply, finish_reason):
    fake = fake_proc()
    audit = tmp_path / "audit.jsonl"
    proxy = proxy_thread(one_backend([fake.base_url], media_root, audit_log=str(audit)))
    fake.script(*[{"reply": reply, "finish_reason": finish_reason}] * 2)
    response = _post(proxy)
    assert outcome(response) == "unparseable_score" and response.json()["error"]["attempts"] == 2
    if finish_reason == "length":
        assert "finish_reason=length" in response.json()["error"]["message"]
    values = metrics(None, proxy.url)
    assert metric_sum(values, "vlm_proxy_parse_failures_total") == 2
    assert metric_sum(values, "vlm_proxy_requests_total", route="/score", outcome="unparseable_score") == 1
    proxy.flush_audit()
    line = json.loads(audit.read_text())
    assert line["error"]["code"] == "unparseable_score" and "score" not in line
    assert line["output_text"] == reply and line["finish_reason"] == finish_reason  # what the model said


def test_connection_reset_is_retried_on_the_next_replica(raw_server, fake_proc, proxy_thread, media_root):
    resetting = raw_server("rst")
    fake = fake_proc()
    proxy = proxy_thread(one_backend([resetting.base_url], media_root))
    response = _post(proxy)
    assert outcome(response) == "upstream_unavailable" and response.json()["error"]["attempts"] == 4
    assert resetting.chats == 4
    both = proxy_thread(one_backend([resetting.base_url, fake.base_url], media_root))
    for _ in range(3):
        response = _post(both)
        assert outcome(response) == "ok"
    values = metrics(None, both.url)
    failed = metric_sum(values, "vlm_proxy_upstream_calls_total", result="upstream_unavailable",
                        endpoint=resetting.base_url)
    assert failed >= 1 and metric_sum(values, "vlm_proxy_upstream_calls_total", result="ok") == 3


BAD_200 = {
    "empty body": http_bytes(200, b""),
    "html": http_bytes(200, b"<html>502 Bad Gateway</html>", content_type="text/html"),
    "json null": http_bytes(200, b"null"),
    "json list": http_bytes(200, b"[1, 2, 3]"),
    "no choices": http_bytes(200, b'{"choices": []}'),
    "choices null": http_bytes(200, b'{"choices": null}'),
    "message missing": http_bytes(200, b'{"choices": [{"index": 0}]}'),
    "not utf-8": http_bytes(200, b'{"choices": "\xff\xfe"}'),
    "bad status line": b"HTTZ/9.9 abc\r\n\r\n",
    "truncated chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n400\r\n{\"choices\": [",
}


@pytest.mark.parametrize("name", list(BAD_200))
def test_garbage_replies_are_upstream_errors(raw_server, proxy_thread, media_root, name):
    server = raw_server(GOOD)
    proxy = proxy_thread(one_backend([server.base_url], media_root))
    server.script(*[BAD_200[name]] * 4)
    response = _post(proxy)
    assert outcome(response) in {"upstream_bad_response", "upstream_unavailable"}, response.text
    assert response.json()["error"]["attempts"] == 4
    assert outcome(_post(proxy)) == "ok"


@pytest.mark.parametrize("name", ["content null, cut", "content empty"])
def test_empty_content_is_unparseable(raw_server, proxy_thread, media_root, name):
    body = completion(None, "length") if name == "content null, cut" else completion("")
    server = raw_server(http_bytes(200, json.dumps(body).encode()))
    proxy = proxy_thread(one_backend([server.base_url], media_root))
    response = _post(proxy)
    assert outcome(response) == "unparseable_score"


@pytest.fixture(scope="module")
def raw_and_proxy(tmp_path_factory):
    """One raw server and one proxy *subprocess* for the cases that currently end in a 500: uvicorn
    logs their tracebacks, and on Python 3.11 formatting tracebacks in two threads at once can trip
    the ast module's global recursion counter (SystemError) in pytest's own report."""
    from tests.fakes.processes import ProxyProcess, RawServer, kill_quietly

    workdir = tmp_path_factory.mktemp("raw_proxy")
    (workdir / "media").mkdir()
    server = RawServer("Qwen2.5-VL-7B-Instruct", GOOD)
    data = one_backend([server.base_url], workdir / "media", retry={"attempts": 1, "parse_attempts": 1})
    data["backends"]["qwen2_5_vl_vllm"]["circuit"] = {"failures": 1000}
    proxy = ProxyProcess(data, workdir)
    try:
        proxy.start()
        yield server, proxy
    finally:
        kill_quietly(proxy, server)


@pytest.mark.parametrize("body", [
    pytest.param(completion(42), id="content number"),
    pytest.param(completion([{"type": "text", "text": "<score>75</score>"}]), id="content parts list"),
    pytest.param({**completion("<score>75</score>"), "model": 7}, id="model number"),
    pytest.param(completion("<score>75</score>", finish_reason=3), id="finish_reason number"),
])
def test_wrongly_typed_completion_fields_are_bad_responses(raw_and_proxy, body):
    server, proxy = raw_and_proxy
    server.script(http_bytes(200, json.dumps(body).encode()))
    response = _post(proxy)
    assert response.headers["content-type"] == "application/json", response.text
    assert outcome(response) == "upstream_bad_response"


def test_undecodable_content_encoding_is_a_bad_response(raw_and_proxy):
    server, proxy = raw_and_proxy
    server.script(http_bytes(200, b"this is not gzip", extra={"content-encoding": "gzip"}))
    response = _post(proxy)
    assert response.headers["content-type"] == "application/json", response.text
    assert outcome(response) == "upstream_bad_response"


def test_the_raw_proxy_still_scores_after_the_bad_replies(raw_and_proxy):
    server, proxy = raw_and_proxy
    server.script(http_bytes(200, gzip.compress(json.dumps(completion("<score>75</score>")).encode()),
                             extra={"content-encoding": "gzip"}))
    assert outcome(_post(proxy)) == "ok"  # a well-formed gzip reply is fine
    assert proxy.alive and outcome(_post(proxy)) == "ok"
