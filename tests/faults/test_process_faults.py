"""vLLM dies, freezes or comes back while the proxy is serving: real processes on loopback.

The fake vLLM runs as `python -m tests.fakes.fake_vllm` so it can be SIGKILLed mid-request,
SIGSTOPped, and restarted on the same port; one test runs the proxy itself as a subprocess
(`python -m vlm_reward_cli serve`). Every episode must end in a score or an explicit error code,
the proxy must stay up, and /metrics (and the audit log, when configured) must account for it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import httpx

from tests.fakes.processes import metric_sum, metrics, wait_circuits_closed
from tests.faults.common import BACKEND, EPISODE, STATUS_OF, UPSTREAM_CODES, one_backend, outcome, patient
from tests.helpers import HANG_S, free_port, wait_until


async def test_fake_killed_mid_request_and_restarted_on_the_same_port(fake_proc, proxy_thread, media_root):
    fake = fake_proc()
    proxy = proxy_thread(one_backend([fake.base_url], media_root,
                                     retry={"attempts": 60, "backoff_s": [0.1, 0.3], "deadline_s": 30}))
    fake.script({"hang_s": 30})
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30, trust_env=False) as http:
        pending = asyncio.create_task(http.post("/score", json=EPISODE))
        await asyncio.to_thread(fake.wait_chats, 1)  # the request is inside vLLM now
        await asyncio.to_thread(fake.kill)
        await asyncio.sleep(0.2)
        await asyncio.to_thread(fake.start)  # same port, fresh process
        response = await asyncio.wait_for(pending, 30)
        assert response.status_code == 200, response.text
        assert outcome(response) == "ok" and response.json()["attempts"] >= 2
        assert fake.chat_count() == 1  # the restarted server answered it
        assert (await http.get("/health")).json()["status"] == "ok"
    values = metrics(None, proxy.url)
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result="upstream_unavailable") >= 1
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result="ok") == 1
    assert metric_sum(values, "vlm_proxy_episodes_total", outcome="ok") == 1
    assert metric_sum(values, "vlm_proxy_in_flight") == 0


def test_dead_fake_is_a_fast_503_and_its_restart_is_picked_up(fake_proc, proxy_thread, media_root):
    fake = fake_proc()
    # no background probe after start-up: the circuit must stay shut on 4 failures, deterministically
    proxy = proxy_thread(one_backend([fake.base_url], media_root, health_interval_s=30))
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        assert http.post("/score", json=EPISODE).status_code == 200  # a keep-alive connection is pooled
        fake.kill()
        response = http.post("/score", json=EPISODE)
        # fast: every try was refused at once (none waited for its timeout: no upstream_timeout)
        assert outcome(response) == "upstream_unavailable" and response.json()["error"]["attempts"] == 4
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert health.json()["backends"][BACKEND]["endpoints"][0]["reason"]
        fake.start()  # same port; the pooled connection is stale
        wait_circuits_closed(proxy.url)
        assert outcome(http.post("/score", json=EPISODE)) == "ok"
        assert http.get("/health").json()["status"] == "ok"
        values = metrics(http, proxy.url)
    assert metric_sum(values, "vlm_proxy_episodes_total", outcome="upstream_unavailable") == 1
    assert metric_sum(values, "vlm_proxy_episodes_total", outcome="ok") == 2
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result="upstream_unavailable") == 4
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result="upstream_timeout") == 0


def test_connection_refused_503_carries_retry_after(proxy_thread, media_root):
    proxy = proxy_thread(one_backend([f"http://127.0.0.1:{free_port()}/v1"], media_root))
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        response = http.post("/score", json=EPISODE)
    assert outcome(response) == "upstream_unavailable"
    assert "retry-after" in response.headers


def test_frozen_fake_times_out_then_recovers_when_resumed(fake_proc, proxy_thread, media_root):
    """SIGSTOP: the kernel still accepts connections, nothing answers until SIGCONT (a wedged
    server), so only the proxy's timeouts can end /score and /health while it is stopped."""
    fake = fake_proc()
    # No background probe after start-up, or it could open the circuit between the two tries; the
    # one probe at start-up runs before the freeze, so its timeout decides nothing here. The deadline
    # is the hang bound: the two 0.5 s tries end long before it, however late their timers fire.
    proxy = proxy_thread(one_backend([fake.base_url], media_root, health_interval_s=30,
                                     retry={"attempts": 2, "timeout_s": 0.5, "deadline_s": HANG_S}))
    with httpx.Client(base_url=proxy.url, timeout=HANG_S * 2, trust_env=False) as http:
        fake.signal(signal.SIGSTOP)
        try:
            response = http.post("/score", json=EPISODE)
            # each try ended by retry.timeout_s (two of them), not by the deadline (one)
            assert outcome(response) == "upstream_timeout" and response.json()["error"]["attempts"] == 2
            # answered although vLLM is still frozen (from the probes and the requests' outcomes)
            health = http.get("/health")
            assert health.status_code == 503 and "upstream_timeout" in json.dumps(health.json())
        finally:
            fake.signal(signal.SIGCONT)
        wait_circuits_closed(proxy.url)
        patient(proxy)  # the resumed vLLM need not answer within 0.5 s on a loaded machine
        assert outcome(http.post("/score", json=EPISODE)) == "ok"
        values = metrics(http, proxy.url)
    assert metric_sum(values, "vlm_proxy_upstream_calls_total", result="upstream_timeout") == 2
    assert metric_sum(values, "vlm_proxy_episodes_total", outcome="upstream_timeout") == 1


async def test_mid_batch_kill_and_restart_with_the_proxy_as_a_subprocess(fake_proc, proxy_proc, media_root,
                                                                         tmp_path):
    """30 episodes arrive over ~1.5 s; vLLM is SIGKILLed a third of the way in and restarted."""
    fake = fake_proc(extra=("--latency-base-s", "0.3"))
    audit = tmp_path / "audit.jsonl"
    proxy = proxy_proc(one_backend([fake.base_url], media_root, audit_log=str(audit),
                                   retry={"attempts": 4, "backoff_s": [0.05, 0.2], "timeout_s": 5,
                                          "deadline_s": 20}))
    count = 30

    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        await asyncio.sleep(0.05 * i)
        return await http.post("/score", json={**EPISODE, "task_text": f"episode {i}"})

    async with httpx.AsyncClient(base_url=proxy.url, timeout=30, trust_env=False) as http:
        tasks = [asyncio.create_task(one(http, i)) for i in range(count)]
        await asyncio.to_thread(fake.wait_chats, 8)
        await asyncio.to_thread(fake.kill)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(fake.start)
        responses = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # none hangs
        outcomes = [outcome(r) for r in responses]
        await asyncio.to_thread(wait_circuits_closed, proxy.url)
        outcomes.append(outcome(await http.post("/score", json={**EPISODE, "task_text": f"episode {count}"})))
        assert outcomes[-1] == "ok"  # the restarted vLLM is back in rotation
        count += 1
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        values = metrics(None, proxy.url)
    assert proxy.alive
    tally = {code: outcomes.count(code) for code in set(outcomes)}
    print("mid-batch outcomes:", tally)
    for code, n in tally.items():
        assert metric_sum(values, "vlm_proxy_episodes_total", outcome=code) == n, (code, values)
    assert metric_sum(values, "vlm_proxy_episodes_total") == count
    assert metric_sum(values, "vlm_proxy_in_flight") == 0
    calls = {dict(labels)["result"]: v for (name, labels), v in values.items()
             if name == "vlm_proxy_upstream_calls_total"}
    assert calls.get("ok") == tally["ok"] and set(calls) <= {"ok", *UPSTREAM_CODES}
    # the writer thread's count (a subprocess: no flush() to call), then the file
    wait_until(lambda: httpx.get(proxy.url + "/health", trust_env=False).json()["audit"]["written"] == count,
               HANG_S, "every audit line written")
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    assert len(lines) == count  # one line per episode, whatever happened to it
    by_task = {line["task_text"]: line for line in lines}
    for i, code in enumerate(outcomes):
        line = by_task[f"episode {i}"]
        if code == "ok":
            assert line["score"] == 0.75 and "error" not in line
        else:
            assert line["error"]["code"] == code and line["attempts"] >= 1
    log = proxy.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log


async def test_client_disconnecting_mid_request_leaves_the_proxy_healthy(fake_proc, proxy_thread, media_root):
    fake = fake_proc()
    proxy = proxy_thread(one_backend([fake.base_url], media_root))
    # vLLM holds its replies until every caller has hung up: each caller's 0.3 s timeout is then the
    # only way its call can end, however slowly a loaded machine runs (a reply delayed by a fixed
    # second could arrive before a timer that fired late).
    fake.script(*[{"hold": "callers gone"}] * 5)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=0.3, trust_env=False) as impatient:
        gone = await asyncio.gather(*(impatient.post("/score", json=EPISODE) for _ in range(5)),
                                    return_exceptions=True)
    assert all(isinstance(r, httpx.ReadTimeout) for r in gone), gone
    # and one that hangs up half-way through sending its body
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n{\"task_text\": \"t\", ")
    fake.release("callers gone")  # the replies now come to callers that have left
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        wait_until(lambda: metric_sum(metrics(http, proxy.url), "vlm_proxy_in_flight") == 0, HANG_S,
                   "the in-flight gauge back at 0")
        assert outcome(http.post("/score", json=EPISODE)) == "ok"
        assert http.get("/health").json()["status"] == "ok"
        values = metrics(http, proxy.url)
    print("after 5 disconnects: requests_total =",
          {dict(k[1]).get("outcome"): v for k, v in values.items() if k[0] == "vlm_proxy_episodes_total"})


async def test_kill_during_a_score_batch(fake_proc, proxy_thread, media_root, tmp_path):
    """POST /score/batch with 24 items, all in vLLM when it is SIGKILLed and restarted: every item
    comes back, in order, scored or with its own explicit error, and each is audited once."""
    fake = fake_proc(extra=("--latency-base-s", "0.3"))
    audit = tmp_path / "audit.jsonl"
    proxy = proxy_thread(one_backend([fake.base_url], media_root, audit_log=str(audit),
                                     retry={"attempts": 8, "backoff_s": [0.1, 0.5], "timeout_s": 5,
                                            "deadline_s": 20}))
    items = [{**EPISODE, "task_text": f"item {i}"} for i in range(24)]
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60, trust_env=False) as http:
        pending = asyncio.create_task(http.post("/score/batch", json={"items": items}))
        await asyncio.to_thread(fake.wait_chats, 24)
        await asyncio.to_thread(fake.kill)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(fake.start)
        response = await asyncio.wait_for(pending, 60)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["index"] for r in results] == list(range(24))
    codes = []
    for result in results:
        if result["ok"]:
            assert result["status"] == 200 and result["result"]["score"] == 0.75
            codes.append("ok")
        else:
            assert result["error"]["code"] in UPSTREAM_CODES and "result" not in result, result
            assert result["status"] == STATUS_OF[result["error"]["code"]]
            codes.append(result["error"]["code"])
    print("batch outcomes:", {c: codes.count(c) for c in set(codes)})
    summary = response.json()["summary"]
    assert summary == {"ok": codes.count("ok"), "failed": 24 - codes.count("ok")}
    values = metrics(None, proxy.url)
    for code in set(codes):
        assert metric_sum(values, "vlm_proxy_episodes_total", outcome=code) == codes.count(code)
    assert metric_sum(values, "vlm_proxy_in_flight") == 0
    proxy.flush_audit()
    lines = {json.loads(line)["task_text"]: json.loads(line) for line in audit.read_text().splitlines()}
    assert len(lines) == 24
    for i, code in enumerate(codes):
        assert lines[f"item {i}"].get("error", "ok") == code


async def test_sigterm_gives_in_flight_requests_the_grace_then_an_explicit_503(fake_proc, proxy_proc, media_root):
    """An upstream reply that never comes must not hold the proxy after SIGTERM: the request in
    flight gets proxy.shutdown_grace_s, then an explicit 503 shutting_down, and the process exits."""
    fake = fake_proc()
    fake.script({"hang_s": 3600})  # vLLM answers nothing while the test runs
    proxy = proxy_proc(one_backend([fake.base_url], media_root, shutdown_grace_s=1,
                                   retry={"attempts": 1, "timeout_s": 3600, "deadline_s": 3600}))
    async with httpx.AsyncClient(base_url=proxy.url, timeout=90, trust_env=False) as http:  # the hang guard
        pending = asyncio.ensure_future(http.post("/score", json=EPISODE))
        await asyncio.to_thread(fake.wait_chats, 1)
        proxy.proc.send_signal(signal.SIGTERM)
        response = await pending  # nothing but the grace running out can answer it
    exit_code = await asyncio.to_thread(proxy.proc.wait, 30)
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
    assert response.json()["error"]["retryable"] is True and "retry-after" in response.headers
    # uvicorn re-raises the signal once it has shut down cleanly: the exit says what stopped it
    assert exit_code in (0, -signal.SIGTERM)
