"""`progress_episodes`: the /progress/batch request, whole tasks per request, strict answers, failures."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from rlinf_client import (
    APIConnectionError,
    Episode,
    EpisodeFrameBuffer,
    EpisodeMetadataError,
    RewardClient,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from rlinf_client import _constants as C
from tests.client._progress_support import FakeProgressProxy, item_error, result
from tests.client._support import decode_npy, error_response, frame_tag, tagged_frames

CFG = {"enable": True, "endpoint": "http://proxy.test/score", "reward_source": "progress", "binary_reward": False,
       "backend": "embed", "nframes": 4, "buffer_frames": 0, "fallback": "zero", "max_retries": 2}


def episode(env: int, task: int | str, success: bool, steps: int = 6, **metadata) -> Episode:
    return Episode(tagged_frames(env, range(steps)), f"task {task}", float(success),
                   metadata={"task_id": task, "env_success": success, **metadata})


def run(fake: FakeProgressProxy, episodes: list[Episode], **overrides):
    with RewardClient({**CFG, **overrides}, http_transport=fake.transport()) as client:
        return client.progress_episodes(episodes), client.stats


@pytest.mark.parametrize("transport", ["binary", "inline"])
def test_one_request_carries_every_episode_with_its_task_and_success(transport):
    fake = FakeProgressProxy()
    episodes = [episode(0, 3, True), episode(1, 3, False), episode(2, 7, False), episode(4, 3, False)]
    results, stats = run(fake, episodes, transport=transport)
    [body] = fake.batches
    assert fake.requests[0][0] == "/progress/batch"
    assert fake.content_types[0].startswith("multipart/" if transport == "binary" else "application/json")
    assert body["backend"] == "embed"
    # grouped by task (a task's episodes travel together), in input order within a task
    assert [(i["metadata"]["task_id"], i["metadata"]["env_success"]) for i in body["items"]] == [
        (3, True), (3, False), (3, False), (7, False)]
    for item, env in zip(body["items"], (0, 1, 4, 2), strict=True):
        # the /score body's frame fields, none of /score's own (the backend is request-wide here)
        assert set(item) <= {"task_text", "frames_npy", "fps", "video_fps", "nframes", "max_pixels", "metadata"}
        assert {frame_tag(f)[0] for f in decode_npy(item["frames_npy"])} == {env}
    assert [(r.ok, r.outcome, r.progress, r.value) for r in results] == [
        (True, "success", 1.0, 1.0), (True, "progress", 0.1, 0.1), (True, "no_reference", None, None),
        (True, "progress", 0.4, 0.4)]
    assert results[1].response["embedding"]["dim"] == 3
    assert (stats.episodes, stats.scored, stats.failures, stats.requests) == (4, 4, 0, 1)


@pytest.mark.parametrize("transport", ["binary", "inline"])
def test_a_second_camera_travels_with_its_item(transport):
    # The wrist view (env + 10 in its tags) at the same steps as the main view: dropped, the
    # embedding backend would see one camera and say nothing (or refuse every request).
    fake = FakeProgressProxy()
    episodes = [Episode(tagged_frames(env, range(6)), "task 3", float(success),
                        extra_view=tagged_frames(10 + env, range(6)), metadata={"task_id": 3, "env_success": success})
                for env, success in ((0, True), (1, False))]
    results, _ = run(fake, episodes, transport=transport)
    [body] = fake.batches
    for item, env in zip(body["items"], (0, 1), strict=True):
        main, wrist = decode_npy(item["frames_npy"]), decode_npy(item["extra_view"]["frames_npy"])
        assert {frame_tag(f)[0] for f in wrist} == {10 + env}
        assert [frame_tag(f)[1] for f in wrist] == [frame_tag(f)[1] for f in main]
    assert [(r.ok, r.outcome) for r in results] == [(True, "success"), (True, "progress")]


def test_a_task_is_never_split_across_requests(monkeypatch):
    """Over the byte cap, whole tasks go in separate requests: each task's math sees all its episodes."""
    fake = FakeProgressProxy()
    episodes = [episode(e, task, e % 3 == 0, steps=8) for e, task in enumerate([1, 2, 1, 2, 3, 1, 3])]
    one_episode = len(np.lib.format.header_data_from_array_1_0(tagged_frames(0, range(4)))) + 4 * 16 * 16 * 3
    monkeypatch.setattr(C, "DEFAULT_MAX_BATCH_BYTES", 4 * one_episode)  # about 2 tasks' worth
    results, _ = run(fake, episodes)
    assert len(fake.batches) > 1
    seen: dict[int, int] = {}
    for number, body in enumerate(fake.batches):
        for item in body["items"]:
            assert seen.setdefault(item["metadata"]["task_id"], number) == number
    assert sorted(seen) == [1, 2, 3]
    assert all(r.ok for r in results) and [r.outcome for r in results][:2] == ["success", "progress"]


@pytest.mark.parametrize("metadata", [{"env_success": False}, {"task_id": None, "env_success": False},
                                      {"task_id": True, "env_success": False}, {"task_id": 1},
                                      {"task_id": 1, "env_success": 0}, None])
def test_an_episode_without_its_task_id_or_success_flag_is_refused_before_sending(metadata):
    fake = FakeProgressProxy()
    with pytest.raises(EpisodeMetadataError, match="metadata"):
        run(fake, [Episode(tagged_frames(0, range(4)), "t", 0.0, metadata=metadata)])
    assert fake.requests == []


def bad_answers():
    """Answers that hold no payable progress for item 0 (the other item is fine)."""
    def with_first(first):
        def rate(item, frames, with_success):
            if item["metadata"]["task_id"] == "a":
                return first(item)
            return result(item, "progress", 0.5)
        return rate

    return {
        "progress without a number": with_first(lambda i: result(i, "progress", None)),
        "progress out of range": with_first(lambda i: result(i, "progress", 1.5)),
        "progress as a bool": with_first(lambda i: result(i, "progress", True)),
        "no_reference with a number": with_first(lambda i: result(i, "no_reference", 0.0)),
        "success for a failure": with_first(lambda i: result(i, "success", 1.0)),
        "an unknown outcome": with_first(lambda i: result(i, "halfway", 0.5)),
        "another task's result": with_first(lambda i: {**result(i, "progress", 0.5),
                                                       "result": {**result(i, "progress", 0.5)["result"],
                                                                  "task_id": "b"}}),
        "no result object": with_first(lambda i: {"ok": True, "status": 200}),
    }


@pytest.mark.parametrize("case", sorted(bad_answers()))
def test_an_invalid_item_fails_alone_and_never_becomes_a_number(case):
    fake = FakeProgressProxy(rate=bad_answers()[case])
    results, stats = run(fake, [episode(0, "a", False), episode(1, "c", False)])
    assert not results[0].ok and results[0].reason == "bad_response" and results[0].value == 0.0  # fallback: zero
    assert results[0].progress is None and results[0].outcome is None
    assert results[1].ok and results[1].progress == 0.5
    assert stats.failure_reasons == {"bad_response": 1}


@pytest.mark.parametrize("answer", [{"results": []}, {"results": "no"}, {"summary": {}}, [1, 2]])
def test_an_answer_of_another_shape_fails_every_item(answer):
    fake = FakeProgressProxy(script=[httpx.Response(200, json=answer)])
    results, _ = run(fake, [episode(0, 1, True), episode(1, 1, False)])
    assert [(r.ok, r.reason) for r in results] == [(False, "bad_response")] * 2


def test_results_out_of_order_are_refused():
    fake = FakeProgressProxy()
    fake.script.append(httpx.Response(200, json={"results": [
        {**result({"metadata": {"task_id": 1, "env_success": False}}, "progress", 0.2), "index": 1},
        {**result({"metadata": {"task_id": 1, "env_success": True}}, "success", 1.0), "index": 0}]}))
    results, _ = run(fake, [episode(0, 1, True), episode(1, 1, False)])
    assert [r.reason for r in results] == ["bad_response", "bad_response"]


@pytest.mark.parametrize(("policy", "values"), [("zero", [0.0, 0.0, 0.5]), ("env_success", [1.0, 0.0, 0.5])])
def test_a_failed_item_follows_the_fallback_policy_with_its_code(policy, values):
    def rate(item, frames, with_success):
        if item["metadata"]["task_id"] == 1:
            return item_error(502, "upstream_error" if item["metadata"]["env_success"] else "progress_group_failed")
        return result(item, "progress", 0.5)

    fake = FakeProgressProxy(rate=rate)
    results, stats = run(fake, [episode(0, 1, True), episode(1, 1, False), episode(2, 2, False)], fallback=policy)
    assert [r.value for r in results] == values
    assert [r.reason for r in results] == ["upstream_error", "progress_group_failed", None]
    assert stats.failures == 2 and stats.scored == 1


def test_fallback_raise_raises_the_first_failure_typed():
    fake = FakeProgressProxy(script=[error_response(422, "invalid_request", "items[1].metadata.task_id",
                                                    field="items[1].metadata.task_id")])
    with pytest.raises(UnprocessableEntityError) as caught:
        run(fake, [episode(0, 1, True), episode(1, 1, False)], fallback="raise")
    assert caught.value.code == "invalid_request" and caught.value.field == "items[1].metadata.task_id"


def test_a_whole_request_error_fails_every_item_of_it_under_zero():
    fake = FakeProgressProxy(script=[error_response(404, "unknown_backend", "no backend embed")])
    results, stats = run(fake, [episode(0, 1, True), episode(1, 1, False)])
    assert [(r.ok, r.reason, r.value) for r in results] == [(False, "unknown_backend", 0.0)] * 2
    assert stats.requests == 1  # a 404 is final: not sent again


def test_retryable_answers_and_refused_connections_are_sent_again_by_the_transport():
    fake = FakeProgressProxy(script=[error_response(429, "overloaded", retry_after="0"),
                                     httpx.ConnectError("refused")])
    results, stats = run(fake, [episode(0, 1, True), episode(1, 1, False)])
    assert [r.outcome for r in results] == ["success", "progress"]
    assert stats.requests == 3 and stats.retries == 2 and results[0].attempts == 3


def test_when_retries_run_out_the_typed_error_is_each_episodes():
    fake = FakeProgressProxy(script=[error_response(503, "shutting_down", retry_after="0")] * 3)
    with pytest.raises(ServiceUnavailableError):
        run(fake, [episode(0, 1, True)], fallback="raise")
    fake = FakeProgressProxy(script=[httpx.ConnectError("refused")] * 3)
    results, _ = run(fake, [episode(0, 1, True)])
    assert results[0].reason == APIConnectionError.code and isinstance(results[0].error, APIConnectionError)


def test_unsendable_frames_fail_their_whole_task_and_only_it():
    fake = FakeProgressProxy()
    empty = Episode(np.zeros((0, 16, 16, 3), np.uint8), "task 1", 0.0, metadata={"task_id": 1, "env_success": False})
    results, _ = run(fake, [episode(0, 1, True), empty, episode(2, 2, True)])
    assert [(r.ok, r.reason) for r in results] == [(False, "invalid_frames"), (False, "invalid_frames"), (True, None)]
    [body] = fake.batches
    assert [i["metadata"]["task_id"] for i in body["items"]] == [2]


def test_no_episodes_no_request():
    fake = FakeProgressProxy()
    assert run(fake, [])[0] == [] and fake.requests == []


def test_the_run_label_is_the_reference_namespace():
    fake = FakeProgressProxy()
    run(fake, [episode(0, 1, True)], run="runD-seed1")
    run(fake, [episode(0, 1, True)])
    assert [b.get("reference_namespace") for b in fake.batches] == ["runD-seed1", None]


def test_a_task_that_failed_only_retryably_is_sent_again_whole():
    """A moment of overload (the proxy's word: retryable) must not stop a run under fallback: raise;
    the task goes again whole, a task that failed for good does not."""
    fake = FakeProgressProxy()
    calls = {"n": 0}

    def rate(item, frames, with_success):
        first_round = calls["n"] < 4
        calls["n"] += 1
        if item["metadata"]["task_id"] == 1 and first_round:
            if item["metadata"]["env_success"]:
                return item_error(429, "overloaded") | {"error": {"code": "overloaded", "message": "busy",
                                                                  "retryable": True}}
            return item_error(429, "progress_group_failed") | {"error": {
                "code": "progress_group_failed", "message": "episode 0 failed", "retryable": True}}
        if item["metadata"]["task_id"] == 2:
            return item_error(422, "media_decode_error")
        return result(item, "success" if item["metadata"]["env_success"] else "progress",
                      1.0 if item["metadata"]["env_success"] else 0.3)

    fake.rate = rate
    results, stats = run(fake, [episode(0, 1, True), episode(1, 1, False), episode(2, 2, False), episode(3, 2, True)])
    assert [len(b["items"]) for b in fake.batches] == [4, 2]  # task 1 again, whole; task 2 (a 422) not
    assert {i["metadata"]["task_id"] for i in fake.batches[1]["items"]} == {1}
    assert [(r.ok, r.outcome) for r in results[:2]] == [(True, "success"), (True, "progress")]
    assert [r.reason for r in results[2:]] == ["media_decode_error"] * 2
    assert results[0].attempts == 2 and stats.retries >= 1


def test_bodies_are_built_in_waves_of_whole_tasks(monkeypatch):
    monkeypatch.setattr(C, "MAX_BODIES_IN_MEMORY", 3)
    fake = FakeProgressProxy()
    tasks = [1, 1, 2, 2, 3, 3, 3, 3]  # waves: [1, 1] + ... never splitting a task; task 3 (4 > 3) alone
    results, _ = run(fake, [episode(e, t, e % 2 == 0) for e, t in enumerate(tasks)])
    assert [sorted({i["metadata"]["task_id"] for i in b["items"]}) for b in fake.batches] == [[1], [2], [3]]
    assert all(r.ok for r in results)


def test_a_stride_that_leaves_out_frames_says_so_in_the_progress_result(caplog):
    """Issue 39, item 5: run D's episodes go through the same frame buffer as /score's: an episode
    embedded on fewer frames than nframes and its steps allowed says so (result, stats, log)."""
    buffer = EpisodeFrameBuffer(capacity=0, stride=6)
    for frame in tagged_frames(0, range(12)):
        buffer.append(frame)
    strided = Episode(buffer, "task 3", 0.0, metadata={"task_id": 3, "env_success": False})
    results, stats = run(FakeProgressProxy(), [strided, episode(1, 3, True, steps=4)], frame_stride=6)
    assert results[0].ok and results[0].frames_short == {"wanted": 4, "sent": 3, "source_count": 12, "stride": 6,
                                                         "why": "stride"}
    assert results[1].frames_short is None
    assert stats.as_dict()["frames_short"] == 1 and "embedded on 3 frames where 4 were asked" in caplog.text
