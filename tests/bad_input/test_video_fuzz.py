"""A fuzz corpus through the real proxy (issue 40): 512 seeded mutations of valid MP4, AVI and MKV
files (bit flips, truncation, box/chunk/element sizes rewritten, index tables inflated) sent as
`video_path`. Every answer is a 200 or a 4xx whose code and message name the cause — never a 5xx —
and afterwards the proxy is alive, healthy and within its memory bound, with no more decoder
processes than media workers. The proxy is its own process (tests/security/_media_stack.py): its
memory and its decoder processes are measured there. The client's timeout only bounds a hang; the
longer run and its numbers are bench/bench_video_fuzz.py's."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import psutil

from tests.fakes.media_corpus import MUTATIONS, mutants, seed_videos
from tests.helpers import HANG_S
from tests.security._media_stack import media_stack
from vlm_protocol.errors import CODES

FILES = 512
SEED = 40
WORKERS = 2
RSS_GROWTH_MB = 256  # the proxy keeps no decoded video frames: they stay in the decoder processes


def _decoders(proxy: psutil.Process) -> list[psutil.Process]:
    """The proxy's decoder processes (the forkserver's children; the forkserver itself is not one)."""
    return [p for child in proxy.children() for p in child.children()]


def test_mutated_videos_are_each_a_200_or_a_4xx_naming_the_cause(tmp_path: Path):
    with media_stack(tmp_path, media_workers=WORKERS) as stack:
        corpus = list(mutants(seed_videos(stack.outside), FILES, SEED))
        for name, _, data in corpus:
            (stack.media / name).write_bytes(data)
        proxy = psutil.Process(stack.proxy.proc.pid)
        assert stack.score(stack.media / corpus[0][0], nframes=4).status_code < 500  # the decoders started
        rss_before = proxy.memory_info().rss

        def ask(name: str):
            return stack.client.post("/score", json={"task_text": "t", "video_path": str(stack.media / name),
                                                     "nframes": 4}, timeout=HANG_S)

        with concurrent.futures.ThreadPoolExecutor(2 * WORKERS) as pool:
            answers = list(pool.map(ask, [name for name, _, _ in corpus]))
        seen: dict[str, dict[int, int]] = {mutation: {} for mutation in MUTATIONS}
        for (name, mutation, _), response in zip(corpus, answers, strict=True):
            status = response.status_code
            seen[mutation][status] = seen[mutation].get(status, 0) + 1
            assert status == 200 or 400 <= status < 500, (name, status, response.text)
            if status != 200:
                error = response.json()["error"]
                assert error["code"] in CODES and CODES[error["code"]].status == status, (name, error)
                assert error["message"] and error.get("field"), (name, error)
        assert all(seen[mutation] for mutation in MUTATIONS), seen
        assert stack.client.get("/health").status_code == 200
        assert stack.proxy.alive
        assert proxy.memory_info().rss <= rss_before + RSS_GROWTH_MB * 2**20
        assert len(_decoders(proxy)) <= WORKERS
