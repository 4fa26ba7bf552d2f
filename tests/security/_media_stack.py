"""A proxy process and two fake vLLMs (threads) on loopback for the media tests, one per test module:
media root `media`, a sibling `outside` that no root covers. The proxy is a separate process so a
decode that escaped would happen where it does in production (and its memory is its own)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import PRIMO_MODEL, QWEN_MODEL, libero_settings_dict
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.processes import ProxyProcess


@dataclass
class MediaStack:
    client: httpx.Client
    qwen: FakeVLLMThread
    primo: FakeVLLMThread
    media: Path
    outside: Path
    proxy: ProxyProcess

    def chat_count(self) -> int:
        return len(self.qwen.chat_requests) + len(self.primo.chat_requests)

    def score(self, path: Path | str, **extra) -> httpx.Response:
        return self.client.post("/score", json={"task_text": "t", "video_path": str(path), **extra})


@contextmanager
def media_stack(base: Path, env: dict[str, str] | None = None, **proxy_overrides) -> Iterator[MediaStack]:
    media, outside = base / "media", base / "outside"
    media.mkdir()
    outside.mkdir()
    qwen = FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL, default_text="<score>75</score>")).start()
    primo = FakeVLLMThread(FakeConfig(served_model_name=PRIMO_MODEL,
                                      default_text="<think>t</think><answer>60</answer>")).start()
    proxy = ProxyProcess(libero_settings_dict([qwen.base_url], [primo.base_url], media, health_interval_s=30,
                                              **proxy_overrides), base, env)
    try:
        proxy.start()
        with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as client:
            yield MediaStack(client, qwen, primo, media, outside, proxy)
    finally:
        proxy.close()
        qwen.stop()
        primo.stop()




def refusal(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error
