"""One proxy (`python -m vlm_reward_cli serve`, a subprocess) and two fake vLLMs (threads) shared by the
bad-input suite. The proxy is a separate process so the tracebacks it logs for known 500s never
race pytest's own traceback formatting (on Python 3.11 that can raise SystemError from `ast`).

Every bad request goes through `env.post`, which times it (the issue wants each refusal in under a
second). The time is a measurement, not an assertion (a loaded 2-core machine would make any
threshold flaky): the terminal summary prints the slowest refusal and how many took 1 s or more.
The autouse `_nothing_sent_upstream` checks that no fake received a chat request (unless the test
asks for `allow_upstream`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import PRIMO_MODEL, PROMPTS_DIR, QWEN_MODEL, libero_settings_dict
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.processes import ProxyProcess
from tests.helpers import SUMMARIES

pytest.register_assert_rewrite("tests.bad_input.common")  # asserts in the shared helpers get pytest's messages

TIMINGS: list[tuple[float, str]] = []


@dataclass
class Env:
    proxy: ProxyProcess
    qwen: FakeVLLMThread
    primo: FakeVLLMThread
    media: Path  # the one allowed media root
    outside: Path  # a sibling directory that is not allowed
    prompts: Path
    client: httpx.Client
    timings: list[tuple[float, str]] = field(default_factory=lambda: TIMINGS)

    def chat_count(self) -> int:
        return len(self.qwen.chat_requests) + len(self.primo.chat_requests)

    def post(self, *, label: str = "", path: str = "/score", **kwargs) -> httpx.Response:
        started = time.perf_counter()
        response = self.client.post(path, **kwargs)
        elapsed = time.perf_counter() - started
        self.timings.append((elapsed, label or str(kwargs.get("json", ""))[:60]))
        return response


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("bad_input")
    media, outside, prompts = base / "media", base / "outside", base / "prompts"
    media.mkdir()
    outside.mkdir()
    shutil.copytree(PROMPTS_DIR, prompts)
    (prompts / "scene.yaml").write_text(
        "variables: {task_text: {}, scene: {}}\nuser: 'In ${scene}: ${task_text}. <score>?</score>'\n"
        "answer: {tags: [score], scale: {min: 0, max: 100}}\n")
    (prompts / "editable.yaml").write_text("variables: {task_text: {}}\nuser: '${task_text} <score>?</score>'\n"
        "answer: {tags: [score], scale: {min: 0, max: 100}}\n")
    qwen = FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL, default_text="<score>75</score>")).start()
    primo = FakeVLLMThread(FakeConfig(served_model_name=PRIMO_MODEL,
                                      default_text="<think>70 of 100</think><answer>60</answer>")).start()
    data = libero_settings_dict([qwen.base_url], [primo.base_url], media, max_body_mb=4,
                                prompts_dir=str(prompts), health_interval_s=30)
    for name in ("scene", "editable"):
        data["backends"][name] = dict(data["backends"]["qwen2_5_vl_vllm"], prompt=name)
    proxy = ProxyProcess(data, base)
    try:
        proxy.start()
        with httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as client:
            yield Env(proxy, qwen, primo, media, outside, prompts, client)
    finally:
        proxy.close()
        qwen.stop()
        primo.stop()


@pytest.fixture
def allow_upstream() -> None:
    """Marks a test whose (valid) request is meant to reach vLLM."""


@pytest.fixture(autouse=True)
def _nothing_sent_upstream(request):
    """A refused request must be refused before anything goes to vLLM."""
    if "env" not in request.fixturenames:
        yield
        return
    env = request.getfixturevalue("env")
    before = env.chat_count()
    yield
    if "allow_upstream" not in request.fixturenames:
        assert env.chat_count() == before, "a bad request reached vLLM"


def _summary() -> list[str]:
    if not TIMINGS:
        return []
    slowest, label = max(TIMINGS)
    over = sum(1 for t, _ in TIMINGS if t >= 1.0)
    return [f"bad_input: {len(TIMINGS)} bad requests, slowest {slowest * 1e3:.0f} ms ({label}); "
            f"{over} took 1 s or more"]


SUMMARIES.append(_summary)
