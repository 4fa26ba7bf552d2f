"""Audit logs built through the real proxy: episodes with known success flags, scored by fake
vLLMs that grade them (tests/fakes/grader.py), plus a few replies that hold no score and a few
episodes that fail. Every score the proxy should log is recomputed here, independently."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import npy_b64
from tests.fakes.grader import grader, grader_score, outcome_episode
from tests.helpers import PRIMO_MODEL, QWEN_MODEL

QWEN, PRIMO = "qwen2_5_vl_vllm", "PRIMO-R1"
BACKENDS = (QWEN, PRIMO)
ANSWERS = {QWEN: lambda s: f"<score>{s}</score>", PRIMO: lambda s: f"<think>x</think><answer>{s}</answer>"}
TASKS = {0: "put the bowl on the plate", 1: "open the top drawer"}
GARBAGE = {QWEN: {21}, PRIMO: {5, 13}}  # episodes whose replies hold no score, per backend
GARBAGE_REPLY = "The robot seems to be doing fine."
MISSING_VIDEO = "no-such-episode.mp4"  # an episode that fails with media_not_found, per backend
# Appended to a graded log: cut short; not an object; a score out of [0, 1].
MALFORMED = ['{"backend": "qwen2_5_vl_vllm", "score": 0.', '["not", "an object"]',
             '{"backend": "PRIMO-R1", "score": 7}']


@dataclass(frozen=True)
class Episode:
    index: int
    task_id: int
    success: bool  # what its last frame shows
    truth_sent: bool = True  # False: the request carries no env_success

    @property
    def task_text(self) -> str:
        return f"{TASKS[self.task_id]} #{self.index}"

    @property
    def episode_id(self) -> str:
        return f"ep{self.index}"

    def metadata(self) -> dict:
        data = {"task_id": self.task_id, "episode_id": self.episode_id, "step": 100 + self.index, "run": "test"}
        return {"env_success": self.success, **data} if self.truth_sent else data


# 40 graded episodes over two tasks (16 successes), and two more without ground truth.
EPISODES = [Episode(i, i % 2, i % 5 in (0, 2)) for i in range(40)] + [
    Episode(40, 0, True, truth_sent=False), Episode(41, 1, False, truth_sent=False)]


@dataclass
class GradedLog:
    audit: Path
    store: Path
    seed: int
    noise: float
    episodes: list[Episode] = field(default_factory=lambda: list(EPISODES))

    def expected_score(self, backend: str, episode: Episode) -> float | None:
        """The score the proxy logs for this episode, or None when the reply holds no score."""
        if episode.index in GARBAGE[backend]:
            return None
        return grader_score(episode.success, f"#{episode.index}", self.seed, self.noise) / 100

    def graded(self, backend: str, task_id: int | None = None) -> tuple[list[float], list[bool]]:
        """Scores and truth of the episodes that count for agreement (scored, env_success sent)."""
        pairs = [(self.expected_score(backend, e), e.success) for e in self.episodes
                 if e.truth_sent and (task_id is None or e.task_id == task_id)]
        pairs = [(s, y) for s, y in pairs if s is not None]
        return [s for s, _ in pairs], [y for _, y in pairs]


def _reply(backend: str, seed: int, noise: float) -> Callable[[dict], str]:
    grade = grader(ANSWERS[backend], seed, noise)

    def reply(body: dict) -> str:
        text = next(p["text"] for p in body["messages"][-1]["content"] if p["type"] == "text")
        number = int(re.findall(r"#(\d+)", text)[-1])
        return GARBAGE_REPLY if number in GARBAGE[backend] else grade(body)
    return reply


def build_graded_log(proxy_factory, fake_vllm_factory, media_root: Path, out_dir: Path, *, seed: int = 0,
                     noise: float = 18.0, name: str = "audit.jsonl", store: Path | None = None) -> GradedLog:
    """Score every episode on both backends through the real proxy (one /score/batch per backend),
    plus one episode per backend whose video does not exist; returns the log's path."""
    qwen = fake_vllm_factory(served_model_name=QWEN_MODEL)
    primo = fake_vllm_factory(served_model_name=PRIMO_MODEL)
    qwen.fake.state.reply_fn = _reply(QWEN, seed, noise)
    primo.fake.state.reply_fn = _reply(PRIMO, seed, noise)
    log = GradedLog(out_dir / name, store or out_dir / "frames", seed, noise)
    settings = settings_from_dict(libero_settings_dict([qwen.base_url], [primo.base_url], media_root,
                                                       audit_log=str(log.audit), frame_store={"dir": str(log.store)}))
    proxy = proxy_factory(settings)
    with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
        for backend in BACKENDS:
            items = [{"task_text": e.task_text, "backend": backend, "metadata": e.metadata(),
                      "frames_npy": npy_b64(outcome_episode(e.success, e.index))} for e in log.episodes]
            answer = http.post("/score/batch", json={"items": items})
            assert answer.status_code == 200, answer.text
            results = answer.json()["results"]
            for episode, result in zip(log.episodes, results, strict=True):
                expected = log.expected_score(backend, episode)
                if expected is None:
                    assert result["error"]["code"] == "unparseable_score", result
                else:
                    assert result["ok"] and result["result"]["score"] == expected, (episode, result)
            missing = http.post("/score", json={
                "task_text": "pick up the book #99", "backend": backend, "video_path": str(media_root / MISSING_VIDEO),
                "metadata": {"env_success": True, "task_id": 0, "episode_id": "ep99"}})
            assert missing.json()["error"]["code"] == "media_not_found", missing.text
    proxy.flush_audit()  # every line is in the file before a report reads it
    return log
