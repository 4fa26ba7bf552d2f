"""Shared fixtures: fake vLLM servers and the real proxy on loopback, settings built in code."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config import Settings, settings_from_dict
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import PRIMO_MODEL, PRIMO_REPLY, PROMPTS_DIR, QWEN_MODEL, QWEN_REPLY, REPO  # noqa: F401 - re-exported: tiers import these from here

_ENV_TO_CLEAR = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "OPENAI_API_KEY", "OPENAI_BASE_URL", "VLLM_API_KEY")


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """Anything a test leaves unclosed is reported by that test, not by whichever test happens to
    be running when the garbage collector next runs (filterwarnings=error makes it a failure)."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see no proxies or API keys from the machine they run on."""
    for name in _ENV_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_vllm_factory() -> Iterator[Callable[..., FakeVLLMThread]]:
    started: list[FakeVLLMThread] = []

    def make(**config: Any) -> FakeVLLMThread:
        fake = FakeVLLMThread(FakeConfig(**config)).start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        fake.stop()


@pytest.fixture
def fake_qwen(fake_vllm_factory) -> FakeVLLMThread:
    return fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)


@pytest.fixture
def fake_primo(fake_vllm_factory) -> FakeVLLMThread:
    return fake_vllm_factory(served_model_name=PRIMO_MODEL, default_text=PRIMO_REPLY)


def libero_settings_dict(qwen_endpoints: list[str], primo_endpoints: list[str],
                         media_root: Path, **proxy_overrides: Any) -> dict:
    """The shipped configs/libero.yaml's shape, pointed at fakes, with fast retries."""
    fast_retry = {"attempts": 4, "parse_attempts": 2, "backoff_s": [0.01, 0.05], "timeout_s": 10,
                  "deadline_s": 30}
    # Probes often, so /health (answered from the probes) follows a fake going down quickly.
    proxy_overrides.setdefault("health_interval_s", 0.2)
    return {
        "proxy": {"allowed_media_roots": [str(media_root)], "prompts_dir": str(PROMPTS_DIR),
                  **proxy_overrides},
        "backends": {
            "qwen2_5_vl_vllm": {
                "model": QWEN_MODEL, "endpoints": qwen_endpoints, "layout": "qwen_video",
                "prompt": "qwen_progress", "score_mode": "percentage", "retry": fast_retry,
                "sampling": {"temperature": 0.0, "max_tokens": 64, "seed": 0},
                "frames": {"nframes": 16, "max_pixels": 200704}, "max_model_len": 32768,
            },
            "PRIMO-R1": {
                "aliases": ["primo_r1_vllm"], "model": PRIMO_MODEL, "endpoints": primo_endpoints,
                "layout": "primo_interleave", "prompt": "primo_r1", "score_mode": "percentage",
                "retry": fast_retry,
                "sampling": {"temperature": 0.01, "top_p": 0.001, "max_tokens": 1024, "seed": 0},
                "frames": {"nframes": 16, "max_pixels": 200704}, "max_model_len": 32768,
            },
        },
    }


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    return root


@pytest.fixture
def libero_settings(fake_qwen, fake_primo, media_root) -> Settings:
    return settings_from_dict(libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root))


@pytest.fixture
def proxy_factory() -> Iterator[Callable[[Settings], ProxyServerThread]]:
    started: list[ProxyServerThread] = []

    def make(settings: Settings) -> ProxyServerThread:
        server = ProxyServerThread(settings).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def proxy_server(proxy_factory, libero_settings) -> ProxyServerThread:
    return proxy_factory(libero_settings)


@pytest.fixture
def client(proxy_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=proxy_server.url, timeout=30, trust_env=False) as http:
        yield http


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything imported and collected so far (ray, matplotlib, schemathesis, every test module)
    lives for the whole session: move it out of the collector's sight (gc.freeze), so the per-test
    full collection above scans only what tests create (0.09 s to ~1 ms a test, measured on
    tests/layout), and still finds what a test leaves unclosed."""
    gc.collect()
    gc.freeze()
