"""Shared fixtures: fake vLLM servers and the real proxy on loopback, settings built in code; how
the suite is spread over pytest-xdist's workers, and the tiers' end-of-run lines."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import settings as hypothesis_settings

from proxy.config import Settings, settings_from_dict
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import HANG_S, PRIMO_MODEL, PRIMO_REPLY, PROMPTS_DIR, QWEN_MODEL, QWEN_REPLY, REPO, summary_lines  # noqa: F401 - re-exported: tiers import these from here

_ENV_TO_CLEAR = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "OPENAI_API_KEY", "OPENAI_BASE_URL", "VLLM_API_KEY")


_RPC_DIR = pytest.StashKey[str]()

# No property test may depend on the machine's speed: hypothesis' default 200 ms deadline failed a
# fresh `make test` when four workers shared two cores with real vLLM servers and MuJoCo. One
# profile for the whole suite; a test's own @settings may change its example count, never the deadline.
hypothesis_settings.register_profile("suite", deadline=None)
hypothesis_settings.load_profile("suite")


def pytest_configure(config: pytest.Config) -> None:
    """Every `vllm serve` a test starts (and every child of it) binds its ZeroMQ IPC sockets under
    VLLM_RPC_BASE_PATH (the system temp dir by default) and leaves them there when it exits, a
    clean SIGTERM included: seven per server, ~50 per run. Here they go to one directory per pytest
    process, removed when it ends; a directory the caller set is used as it is."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return
    config.stash[_RPC_DIR] = os.environ["VLLM_RPC_BASE_PATH"] = directory = tempfile.mkdtemp(prefix="vllm-rpc-")
    if len(directory) + 37 > 107:  # vLLM binds <dir>/<uuid4>: a Unix socket's name is at most 107 bytes
        raise pytest.UsageError(f"{directory} is too long a directory for vLLM's sockets: set VLLM_RPC_BASE_PATH")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _RPC_DIR in config.stash:
        shutil.rmtree(config.stash[_RPC_DIR], ignore_errors=True)


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
    # Short backoffs keep retries quick; the call timeout and deadline are hang bounds only, so a
    # reply slowed by a loaded machine is never mistaken for a failure.
    fast_retry = {"attempts": 4, "parse_attempts": 2, "backoff_s": [0.01, 0.05], "timeout_s": HANG_S,
                  "deadline_s": 2 * HANG_S}
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


# --- running in parallel (`make test`: pytest-xdist, `-n 4 --dist loadscope --no-loadscope-reorder`) ---
# Most of the suite waits (on sockets, subprocesses, timeouts), so 4 workers on 2 cores finish
# sooner than 1. A module's tests stay in one worker, so module-scoped stacks start once; a tier
# with one session-scoped stack for all its modules is one scope, so it starts once too, and so is
# the reference tier (three modules of subprocess work, one after another: the heavy tiers take
# three workers at most, the fourth runs the quick ones). (Not `--dist loadgroup`: under pytest
# 9.2 xdist 3.8 cannot add its group suffix to a test's id.)
ONE_WORKER_TIERS = ("real_vllm", "reference")
# Minutes of subprocess start-up: these start first and the quick tiers fill the other workers.
FIRST_TIERS = ("real_rlinf", "real_vllm", "reference")
TESTS_DIR = Path(__file__).resolve().parent
_WORKER_LINES: list[str] = []


def _tier(item: pytest.Item) -> str:
    return item.path.relative_to(TESTS_DIR).parts[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start the long scopes first (the first tiers, then modules marked `slow`); a stable sort,
    so each tier's own order (tests/real_vllm/conftest.py puts the replica kill last) holds."""
    rank = {tier: n for n, tier in enumerate(FIRST_TIERS)}
    items.sort(key=lambda item: (rank.get(_tier(item), len(rank)), item.get_closest_marker("slow") is None))


def _scope(nodeid: str) -> str:
    """A test's unit of work for xdist: its module, or its whole tier (ONE_WORKER_TIERS)."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in ONE_WORKER_TIERS else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleOrStack(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ByModuleOrStack(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # set in an xdist worker only
    if workeroutput is not None:
        workeroutput["summary_lines"] = summary_lines()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _WORKER_LINES.extend(getattr(node, "workeroutput", {}).get("summary_lines", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _WORKER_LINES + summary_lines():
        terminalreporter.write_line(line)
