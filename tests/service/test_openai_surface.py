"""The proxy as an OpenAI-compatible server: the official `openai` client works unchanged."""

import json

import httpx
import openai
import pytest

from tests.conftest import PRIMO_MODEL, QWEN_MODEL


def _client(proxy_server, cls=openai.OpenAI):
    return cls(base_url=proxy_server.url + "/v1", api_key="unused", max_retries=0, timeout=30,
               http_client=(httpx.Client if cls is openai.OpenAI else httpx.AsyncClient)(trust_env=False))


def test_models_lists_every_backend_name_model_and_alias(proxy_server):
    with _client(proxy_server) as client:
        ids = {m.id for m in client.models.list()}
    assert {QWEN_MODEL, PRIMO_MODEL, "qwen2_5_vl_vllm", "PRIMO-R1", "primo_r1_vllm"} <= ids


def test_chat_is_routed_by_model_and_returned_as_vllm_answered(proxy_server, fake_qwen, fake_primo):
    with _client(proxy_server) as client:
        reply = client.chat.completions.create(
            model="primo_r1_vllm", messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert reply.choices[0].message.content.endswith("<answer>60</answer>")
    assert fake_primo.chat_requests[-1]["model"] == PRIMO_MODEL  # alias rewritten to the served name
    assert fake_qwen.chat_requests == []


async def test_async_client_and_streaming(proxy_server, fake_qwen):
    fake_qwen.script({"reply": "one two three"})
    async with _client(proxy_server, openai.AsyncOpenAI) as client:
        stream = await client.chat.completions.create(
            model=QWEN_MODEL, messages=[{"role": "user", "content": "count"}], stream=True)
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
        whole = await client.chat.completions.create(model=QWEN_MODEL, messages=[{"role": "user", "content": "x"}])
    assert "".join(pieces) == "one two three" and len(pieces) >= 3
    assert whole.choices[0].message.content == "<score>75</score>"


def test_streaming_retries_before_the_first_byte(proxy_server, fake_qwen):
    fake_qwen.script({"status": 503}, {"reply": "after retry"})
    with _client(proxy_server) as client:
        stream = client.chat.completions.create(model=QWEN_MODEL, messages=[{"role": "user", "content": "x"}],
                                                stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == "after retry" and len(fake_qwen.chat_requests) == 2


def test_upstream_4xx_is_passed_through_unchanged(proxy_server, fake_vllm_factory, fake_qwen):
    fake_qwen.script({"status": 400, "message": "bad things"})
    with _client(proxy_server) as client, pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=QWEN_MODEL, messages=[{"role": "user", "content": "x"}])
    assert "bad things" in str(err.value)
    assert len(fake_qwen.chat_requests) == 1  # a 400 is not retried


def test_unknown_model_is_404_listing_known_ones(proxy_server):
    with _client(proxy_server) as client, pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert "qwen2_5_vl_vllm" in str(err.value)


def test_bearer_token_guards_everything_but_health(proxy_factory, fake_qwen, fake_primo, media_root, monkeypatch):
    from proxy.config import settings_from_dict
    from tests.conftest import libero_settings_dict
    monkeypatch.setenv("PROXY_TOKEN", "t0ken")
    server = proxy_factory(settings_from_dict(libero_settings_dict(
        [fake_qwen.base_url], [fake_primo.base_url], media_root, api_key_env="PROXY_TOKEN")))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 401
        assert http.post("/score", json={}).json()["error"]["code"] == "unauthorized"
        assert http.get("/metrics", headers={"authorization": "Bearer t0ken"}).status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="t0ken", max_retries=0,
                           http_client=httpx.Client(trust_env=False))
    with client:
        assert client.chat.completions.create(model=QWEN_MODEL, messages=[{"role": "user", "content": "x"}])


def test_only_model_is_rewritten_wherever_it_sits_in_the_body(proxy_server, fake_primo):
    # `model` last, after strings holding quotes, backslashes and brackets: routing reads it
    # without parsing the rest, and vLLM receives every other field as the caller sent it.
    body = {"messages": [{"role": "user", "content": 'a "quoted" \\ {[ text'}], "temperature": 0,
            "max_tokens": 7, "model": "primo_r1_vllm"}
    with httpx.Client(base_url=proxy_server.url, timeout=30) as http:
        response = http.post("/v1/chat/completions", content=json.dumps(body, indent=1).encode(),
                             headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert fake_primo.chat_requests[-1] == {**body, "model": PRIMO_MODEL}


@pytest.mark.parametrize("raw, field, says", [
    (b'{"model": "qwen2_5_vl_vllm", "messages": [}', "body", "not valid JSON"),
    (b'{"model": "qwen2_5_vl_vllm", "model": "primo_r1_vllm", "messages": []}', "body", "given twice"),
    (b'[{"model": "qwen2_5_vl_vllm"}]', "body", "not a JSON object"),
    (b'{"model": ["qwen2_5_vl_vllm"], "messages": []}', "model", "string 'model'"),
    (b'{"messages": []}', "model", "string 'model'"),
    (b'{"model": "score:qwen2_5_vl_vllm", "messages": [1, nope]}', "body", "not valid JSON"),
])
def test_a_body_routing_cannot_read_is_a_422_and_reaches_no_replica(proxy_server, fake_qwen, fake_primo,
                                                                    raw, field, says):
    with httpx.Client(base_url=proxy_server.url, timeout=30) as http:
        response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["field"] == field and says in error["message"]
    assert fake_qwen.chat_requests == [] and fake_primo.chat_requests == []
