"""The frames and the backend's vLLM key go to the endpoint itself and nowhere else (issue 24,
item 1): a replica that answers with a redirect is a broken reply, never followed. On main the
proxy's aiohttp session followed a 307 to any host (past proxy.admin_endpoint_hosts), sent the
frames there, and scored its reply; on a same-origin redirect the key went along too.

A fresh proxy per test: the redirecting replica's circuit is part of what is checked."""

from __future__ import annotations

import httpx

from proxy.config import settings_from_dict
from tests.conftest import QWEN_MODEL, QWEN_REPLY
from tests.faults.common import BACKEND, EPISODE, one_backend

KEY = "vllm-backend-key"


def test_a_redirecting_replica_is_a_broken_reply_and_nothing_reaches_the_target(
        monkeypatch, proxy_factory, fake_vllm_factory, media_root):
    monkeypatch.setenv("QWEN_KEY", KEY)
    target = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    replica = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY, api_key=KEY)
    data = one_backend([replica.base_url], media_root, health_interval_s=3600,
                       retry={"attempts": 2, "parse_attempts": 1, "timeout_s": 10, "deadline_s": 30})
    data["backends"][BACKEND]["api_key_env"] = "QWEN_KEY"
    for location in (target.base_url + "/chat/completions", replica.base_url + "/chat/completions"):
        replica.script(*[{"status": 307, "location": location}] * 2)
        proxy = proxy_factory(settings_from_dict(data))
        with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
            answer = http.post("/score", json=EPISODE)
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["code"] == "upstream_bad_response" and "redirect" in error["message"], error
        assert len(replica.chat_requests) == 2  # each attempt stopped at the replica
        replica.fake.reset()
        assert target.chat_requests == []
