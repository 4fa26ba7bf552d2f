"""Fixtures for the fault suite: fakes and proxies as real processes, all killed and reaped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from proxy.config import settings_from_dict
from tests.conftest import QWEN_MODEL
from tests.fakes.processes import FakeProcess, ProxyProcess, RawServer, kill_quietly
from tests.fakes.proxy_server import ProxyServerThread

pytest.register_assert_rewrite("tests.faults.common")  # asserts in the shared helpers get pytest's messages


@pytest.fixture
def fake_proc(tmp_path) -> Iterator[Callable[..., FakeProcess]]:
    started: list[FakeProcess] = []

    def make(model: str = QWEN_MODEL, **kwargs) -> FakeProcess:
        fake = FakeProcess(model, tmp_path / f"fake{len(started)}.log", **kwargs)
        started.append(fake)
        return fake.start()

    yield make
    kill_quietly(*started)


@pytest.fixture
def raw_server() -> Iterator[Callable[..., RawServer]]:
    started: list[RawServer] = []

    def make(default: bytes | str, model: str = QWEN_MODEL) -> RawServer:
        server = RawServer(model, default)
        started.append(server)
        return server

    yield make
    kill_quietly(*started)


@pytest.fixture
def proxy_thread(proxy_factory) -> Callable[[dict], ProxyServerThread]:
    """The shared in-process proxy factory (tests/conftest.py), fed a config dict."""
    return lambda data: proxy_factory(settings_from_dict(data))


@pytest.fixture
def proxy_proc(tmp_path) -> Iterator[Callable[[dict], ProxyProcess]]:
    started: list[ProxyProcess] = []

    def make(data: dict) -> ProxyProcess:
        proxy = ProxyProcess(data, tmp_path)
        started.append(proxy)
        return proxy.start()

    yield make
    kill_quietly(*started)
