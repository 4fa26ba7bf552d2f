"""The calls one /score request makes from its route to vLLM, traced on the real proxy: the chain of
the proxy's own functions that is on the stack when the one upstream call starts. The chain is a
handful of hops, each with one job, and none takes a flag that says what kind of call it is."""

from __future__ import annotations

import sys
from pathlib import Path

from proxy.upstream.client import UpstreamClient
from tests.fakes.episodes import episode_frames, npy_b64
from tests.helpers import REPO

PROXY = REPO / "proxy"
# The mode arguments the Scorer's score() took before one envelope carried each route's effects.
MODE_FLAGS = {"admit", "encoded", "dense", "probe", "episode", "mode", "kind"}


def _proxy_frames_on_stack() -> list[tuple[str, str, tuple[str, ...]]]:
    """(module path, qualified name, parameter names) of the proxy's frames, outermost first."""
    frame, chain = sys._getframe(1), []
    while frame is not None:
        code = frame.f_code
        path = Path(code.co_filename)
        if path.is_relative_to(PROXY):
            count = code.co_argcount + code.co_kwonlyargcount
            chain.append((str(path.relative_to(REPO)), code.co_qualname, code.co_varnames[:count]))
        frame = frame.f_back
    return chain[::-1]


def test_one_score_goes_route_envelope_scorer_ask_client_and_takes_no_mode_flags(proxy_server, client, monkeypatch):
    seen: list[list[tuple[str, str, tuple[str, ...]]]] = []
    chat = UpstreamClient.chat

    async def traced(self, *args, **kwargs):
        seen.append(_proxy_frames_on_stack())
        return await chat(self, *args, **kwargs)

    monkeypatch.setattr(UpstreamClient, "chat", traced)  # the real call still runs: instrumented, not replaced
    episode = {"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 56, 56)), "metadata": {"run": "call-path"}}
    response = client.post("/score", json=episode)
    assert response.status_code == 200, response.text
    assert len(seen) == 1, "one /score, one upstream call"
    names = [name for _, name, _ in seen[0]]
    print("the /score call path, middleware included:", " → ".join(names))
    assert "score_route" in names, names
    chain = seen[0][names.index("score_route"):]  # from the route (the middleware is every route's)
    names = [name for _, name, _ in chain]
    assert chain[0][0] == "proxy/http/score_routes.py"
    # Before one envelope, the same request went score → Scorer.score → Scorer._score →
    # call_with_retries → _score.<locals>.send → Backend.call → send.<locals>.ask: 7 hops.
    assert names == ["score_route", "score_episode", "score_frames", "Backend.ask",
                     "call_with_retries", "Backend._attempts.<locals>.attempt_call"], names  # then the client's chat
    flagged = {name: sorted(MODE_FLAGS & set(params)) for _, name, params in chain if MODE_FLAGS & set(params)}
    assert not flagged, f"functions on the /score path that take a mode flag: {flagged}"
