"""usage.prompt_tokens from the real server = text tokens + the vision tokens the proxy reports.

For each layout (qwen_video: Qwen backend; primo_interleave: PRIMO-R1 backend), each source
(MP4 under allowed_media_roots, PNG frames, frames_npy) and 1, 7, 16, 40, 100 frames (PRIMO is
clamped to its clamp_nframes_to 22), plus non-square frames and several max_pixels. The text part is
measured ONCE per template: the same rendered messages without their media, sent to the real
server's POST /tokenize (and cross-checked with a text-only chat call). The vision part is the
Qwen2.5-VL rule applied to what the proxy says it sent (frames.count, size, still_size), which
must also equal the proxy's own frames.vision_tokens.

Random weights never give a score: each /score is a 502 unparseable_score, whose usage and frames
come from the audit log line of that request (metadata.run names it).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from tests.real_vllm.stack import (
    PRIMO,
    PRIMO_MODEL,
    QWEN,
    QWEN_MODEL,
    TASK,
    RealStack,
    episode_source,
    say,
    shipped_backends,
    text_only_messages,
    vision_tokens_of,
)

pytestmark = pytest.mark.real_vllm

PRIMO_MAX_NFRAMES = 22  # configs/libero.yaml frames.clamp_nframes_to (asserted below)
LAYOUTS = {QWEN: "qwen_video", PRIMO: "primo_interleave"}


@dataclass(frozen=True)
class Case:
    backend: str
    source: str
    nframes: int
    height: int = 224
    width: int = 224
    max_pixels: int | None = None  # None: the backend's frames.max_pixels (200704)

    @property
    def run(self) -> str:
        return (f"tokens-{self.backend}-{self.source}-{self.nframes}-{self.height}x{self.width}"
                f"-{self.max_pixels or 'default'}")


CASES = [Case(b, s, n) for b in (QWEN, PRIMO) for s in ("mp4", "png", "npy") for n in (1, 7, 16, 40, 100)] + [
    Case(QWEN, "png", 16, 256, 320),                    # non-square, upscaled to the video floor
    Case(QWEN, "npy", 16, 480, 640),                    # non-square, shrunk to max_pixels
    Case(QWEN, "mp4", 16, 480, 640, max_pixels=401408),
    Case(QWEN, "npy", 7, 480, 640, max_pixels=100352),
    Case(PRIMO, "npy", 16, 256, 320),
    Case(PRIMO, "png", 16, 480, 640, max_pixels=401408),
    Case(PRIMO, "mp4", 7, 224, 224, max_pixels=50176),  # below the video floor: stills follow it, video not
    Case(PRIMO, "npy", 16, 480, 640, max_pixels=100352),
]


def _text_tokens(stack: RealStack) -> dict[str, int]:
    out = {}
    with httpx.Client(timeout=60, trust_env=False) as http:
        for backend, port_key, model in ((QWEN, "qwen_r0", QWEN_MODEL), (PRIMO, "primo", PRIMO_MODEL)):
            messages = text_only_messages(backend)
            url = stack.server_url(port_key)
            tokenized = http.post(f"{url}/tokenize", json={"model": model, "messages": messages})
            assert tokenized.status_code == 200, tokenized.text
            chat = http.post(f"{url}/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0})
            assert chat.status_code == 200, chat.text
            count = tokenized.json()["count"]
            assert chat.json()["usage"]["prompt_tokens"] == count, (chat.json()["usage"], count)
            out[backend] = count
    return out


def _score(http: httpx.Client, stack: RealStack, case: Case) -> tuple[Case, int, str]:
    source_count = case.nframes + 3  # the proxy samples nframes of them
    body = {"task_text": TASK, "backend": case.backend, "nframes": case.nframes, "metadata": {"run": case.run},
            **episode_source(case.source, source_count, case.height, case.width, stack.media_root)}
    if case.max_pixels:
        body["max_pixels"] = case.max_pixels
    answer = http.post("/score", json=body)
    code = answer.json()["error"]["code"] if answer.status_code != 200 else "scored"
    return case, answer.status_code, code


def test_prompt_tokens_equal_text_plus_vision_tokens(real_stack: RealStack) -> None:
    assert shipped_backends()[PRIMO]["frames"]["clamp_nframes_to"] == PRIMO_MAX_NFRAMES
    text = _text_tokens(real_stack)
    say(f"text tokens per template (POST /tokenize == text-only chat usage): {text}")

    for case in CASES:  # MP4 files first: two threads must not write (and read) one file at once
        if case.source == "mp4":
            episode_source("mp4", case.nframes + 3, case.height, case.width, real_stack.media_root)
    with httpx.Client(base_url=real_stack.proxy_url, timeout=600, trust_env=False) as http, \
            ThreadPoolExecutor(3) as pool:  # two Qwen replicas and PRIMO busy at once
        answers = list(pool.map(lambda case: _score(http, real_stack, case), CASES))
    # Random weights: a reply with a score would be luck, but its usage counts all the same.
    bad = [(c.run, status, code) for c, status, code in answers if code not in ("unparseable_score", "scored")]
    assert not bad, f"requests that did not reach the model: {bad}"

    rows, mismatches = [], []
    for case in CASES:
        record = real_stack.audit.one(case.run)
        frames, usage = record["frames"], record["usage"]
        layout = LAYOUTS[case.backend]
        expected_count = min(case.nframes, PRIMO_MAX_NFRAMES) if case.backend == PRIMO else case.nframes
        assert frames["count"] == expected_count and frames["requested"] == case.nframes, (case, frames)
        vision = vision_tokens_of(layout, frames)
        assert frames["vision_tokens"] == vision, (case, frames["vision_tokens"], vision)
        expected, got = text[case.backend] + vision, usage["prompt_tokens"]
        row = {"layout": layout, "source": case.source, "frames": frames["count"], "requested": case.nframes,
               "source_size": f"{case.width}x{case.height}", "max_pixels": case.max_pixels,
               "size": "x".join(map(str, frames["size"])),
               "still_size": "x".join(map(str, frames["still_size"])) if frames["still_size"] else None,
               "text": text[case.backend], "vision": vision, "expected": expected, "got": got,
               "ok": expected == got}
        rows.append(row)
        if expected != got:
            mismatches.append(f"{case.run}: expected {expected} (text {text[case.backend]} + vision {vision}), "
                              f"server counted {got}")

    header = (f"{'layout':<17} {'source':<6} {'frames':>9} {'source':>8} {'max_px':>7} {'size':>8} "
              f"{'stills':>8} {'expected':>9} {'got':>6}  ok")
    lines = [header, "-" * len(header)]
    for r in rows:
        frames = f"{r['frames']}/{r['requested']}" if r["frames"] != r["requested"] else str(r["frames"])
        lines.append(f"{r['layout']:<17} {r['source']:<6} {frames:>9} {r['source_size']:>8} "
                     f"{r['max_pixels'] or '-':>7} {r['size']:>8} {r['still_size'] or '-':>8} "
                     f"{r['expected']:>9} {r['got']:>6}  {'yes' if r['ok'] else 'NO'}")
    table = "\n".join(lines)
    print(f"\nprompt tokens: real server vs text + vision (frames: sent/requested)\n{table}", flush=True)
    out = real_stack.run_dir / "token_counts.json"
    out.write_text(json.dumps({"text_tokens": text, "rows": rows}, indent=1))
    say(f"token table ({len(rows)} rows) written to {out}")
    assert len(rows) >= 12
    assert not mismatches, "prompt token mismatches:\n" + "\n".join(mismatches)
