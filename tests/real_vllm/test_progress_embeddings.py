"""POST /progress/batch on a real pooling server: `up` starts the tiny Qwen2.5-VL checkpoint with
--runner pooling --convert embed (kind: embedding), vLLM accepts the proxy's /v1/embeddings body
(a video part with media_io_kwargs), every frame sent is counted, the vectors are what the SRPO
math is run on (checked against the scikit-learn oracle), and the call's cost per episode is
printed and kept in the tier's timings."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from tests.real_vllm.stack import EMBED, EMBED_MODEL, OMP_BIND, TASK, RealStack, episode_source, say
from tests.reference.srpo_oracle import siirl_rewards

pytestmark = pytest.mark.real_vllm


def test_the_embedding_replica_is_a_pooling_server(real_stack: RealStack, http) -> None:
    line = real_stack.command_line(f"{EMBED}-r0")
    for flag in ("--runner pooling --convert embed", f"--served-model-name {EMBED_MODEL}",
                 "--trust-request-mm-kwargs", """--limit-mm-per-prompt '{"video": 1}'""",
                 f"VLLM_CPU_OMP_THREADS_BIND={OMP_BIND['embed']}"):
        assert flag in line, f"{flag!r} not in the embedding replica's command line: {line}"
    log = (real_stack.run_dir / f"{EMBED}-r0.log").read_text(errors="replace")
    args = next(line for line in log.splitlines() if "non-default args:" in line)
    assert "'runner': 'pooling'" in args and "'convert': 'embed'" in args, args
    health = http.get("/health").json()["backends"][EMBED]
    assert health["ready"] and health["model"] == EMBED_MODEL, health


def _item(task: int, success: bool, count: int, variant: int, media_root, **extra) -> dict:
    return {"task_text": TASK, **episode_source("npy", count, 112, 112, media_root, variant=variant), "fps": 20,
            "metadata": {"task_id": task, "env_success": success, "run": "progress-real"}, **extra}


def test_progress_on_real_embeddings(real_stack: RealStack, http) -> None:
    root = real_stack.media_root
    items = [_item(1, True, 16, 0, root), _item(1, True, 16, 3, root), _item(1, False, 12, 9, root),
             _item(1, False, 20, 20, root), _item(1, False, 16, 0, root),  # the first success's frames
             _item(2, False, 16, 5, root), _item(2, True, 16, 5, root, nframes=4)]
    response = http.post("/progress/batch", json={"backend": EMBED, "items": items, "include_embeddings": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert all(r["ok"] for r in answer["results"]), answer["results"]
    results = [r["result"] for r in answer["results"]]
    vectors = np.array([r["embedding"]["vector"] for r in results])
    dims = {r["embedding"]["dim"] for r in results}
    assert len(dims) == 1 and vectors.shape == (7, dims.pop())
    assert np.linalg.norm(vectors, axis=1) == pytest.approx(np.ones(7), abs=1e-4)  # the pooler normalises
    assert vectors[4] == pytest.approx(vectors[0], abs=1e-5)  # the same frames: the same vector
    # Every frame sent is counted: prompt tokens = the frames' vision tokens + one fixed template cost.
    overhead = {r["embedding"]["usage"]["prompt_tokens"] - r["embedding"]["frames"]["vision_tokens"]
                for r in results}
    assert len(overhead) == 1 and overhead.pop() > 0
    assert results[6]["embedding"]["frames"]["count"] == 4 and results[0]["embedding"]["frames"]["count"] == 8
    oracle = siirl_rewards(vectors, np.array([i["metadata"]["env_success"] for i in items]),
                           [str(i["metadata"]["task_id"]) for i in items])
    for k, result in enumerate(results):
        if result["outcome"] == "progress":
            assert 0.6 * result["progress"] == pytest.approx(oracle[k]["score"], abs=1e-9)
        else:
            assert result["outcome"] == "success" and oracle[k]["score"] == 1.0
    assert [r["outcome"] for r in results] == ["success", "success", "progress", "progress", "progress",
                                               "progress", "success"]
    assert results[4]["progress"] > 0.5  # as close to the successes as a failure can be

    upstream_ms = [r["embedding"]["timings_ms"]["upstream"] for r in results]
    tokens = [r["embedding"]["usage"]["prompt_tokens"] for r in results if r["embedding"]["frames"]["count"] == 8]
    real_stack.timings["embedding call per episode, median ms (8 frames 112x112, 7 concurrent)"] = round(
        statistics.median(upstream_ms), 1)
    real_stack.timings["embedding prompt tokens per episode (8 frames 112x112)"] = tokens[0]
    say(f"embedding calls: median {statistics.median(upstream_ms):.0f} ms upstream per episode "
        f"(7 concurrent, max {max(upstream_ms):.0f} ms), {tokens[0]} prompt tokens for 8 frames at 112x112, "
        f"dim {vectors.shape[1]}")
    lines = real_stack.audit.wait_for("progress-real", 7)
    assert len(lines) == 7 and all(line["kind"] == "progress" and line["endpoint"] == real_stack.server_url("embed")
                                   + "/v1" for line in lines)
