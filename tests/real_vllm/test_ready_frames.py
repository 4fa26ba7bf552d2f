"""The RLinf client's frames made in the env worker (frame_encoding: auto, GET /frame-rules) cost the
real server exactly what the proxy's own frames cost: the same prompt tokens, the same JPEG bytes,
for both layouts (PRIMO-R1's two stills included) and for frames the proxy shrinks or enlarges.

Random weights: a score would be luck, so the usage and the frames come from the audit line of each
request (metadata.run names it), scored or not.
"""

from __future__ import annotations

import pytest

from rlinf_client import Episode, RewardClient
from tests.fakes.episodes import episode_frames
from tests.real_vllm.stack import PRIMO, QWEN_ONE_ASK, TASK, RealStack, say

pytestmark = pytest.mark.real_vllm

SHAPES = [(256, 256), (480, 640)]  # LIBERO's (enlarged to the video floor), and one shrunk to max_pixels


def _scored(stack: RealStack, backend: str, encoding: str, shape: tuple[int, int]) -> dict:
    run = f"ready-{backend}-{encoding}-{shape[0]}x{shape[1]}"
    cfg = {"enable": True, "endpoint": f"{stack.proxy_url}/score", "backend": backend, "timeout": 600,
           "batch": "never", "frame_encoding": encoding}
    with RewardClient(cfg) as client:
        [result] = client.score_episodes([Episode(episode_frames(40, *shape), TASK, 0.0, metadata={"run": run})])
    assert result.ok or result.reason == "unparseable_score", result.error  # it reached the model
    return stack.audit.one(run)


@pytest.mark.parametrize("backend", [QWEN_ONE_ASK, PRIMO])
def test_frames_made_in_the_env_cost_the_prompt_tokens_the_proxys_own_cost(real_stack: RealStack, backend) -> None:
    rows = []
    for shape in SHAPES:
        raw, ready = (_scored(real_stack, backend, encoding, shape) for encoding in ("raw", "auto"))
        stills = 2 if backend == PRIMO else 0
        assert (raw["frames"]["forwarded"], ready["frames"]["forwarded"]) == (0, 16 + stills)
        assert ready["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
        for key in ("size", "still_size", "sha256", "still_sha256", "vision_tokens"):
            assert ready["frames"][key] == raw["frames"][key], key
        rows.append(f"{shape[1]}x{shape[0]} → {raw['frames']['size']}: {ready['usage']['prompt_tokens']} prompt tokens")
    say(f"client-made frames, {backend}: " + "; ".join(rows) + " (raw = client-made)")
