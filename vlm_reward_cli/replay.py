"""`vlm-reward-proxy replay`: re-score the episodes of an audit log from the frame store with
another template, backend or sampling, through the proxy's own pipeline, into a new audit log.

The proxy app runs in this process (its lifespan, routes, validation, retries and audit log; no
socket) and each stored episode is POSTed to its /score as the JPEGs vLLM received the first time,
with the episode's metadata (ground truth included) carried over, so `report OLD --compare NEW`
judges a prompt edit against the simulator before any RL run. What cannot be replayed (no frame
hashes, a frame missing from the store) is counted and named, never guessed.

The stored JPEGs are decoded and re-encoded by the pipeline (a second JPEG generation at the
backend's quality), and PRIMO's first/last stills are re-derived from the stored video frames.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from proxy.errors import ConfigError
from reports.audit_lines import audit_files, audit_records
from vlm_protocol.frame_store import frame_path
from vlm_protocol.wire import SCORE_PATH
from vlm_reward_cli.progress import ProgressLine

__all__ = ["add_subcommand", "replay"]


@dataclass
class ReplayTally:
    sent: int = 0
    scored: int = 0
    failed: Counter = field(default_factory=Counter)  # error code -> episodes
    skipped: Counter = field(default_factory=Counter)  # why an audit line was not replayed

    def line(self) -> str:
        failed = ", ".join(f"{code} {n}" for code, n in self.failed.most_common()) or "0"
        skipped = ", ".join(f"{why} {n}" for why, n in self.skipped.most_common()) or "0"
        return f"sent {self.sent}, scored {self.scored}, failed {failed}, skipped {skipped}"


def replay_settings(config: Path, backend: str, out: Path, prompt: str | None, sampling: list[str],
                    frame_store: Path | None) -> tuple[Any, str, Path]:
    """The config with the replay's changes, validated as a whole: (settings, backend key, store)."""
    from proxy.config import read_config, settings_from_dict

    data = read_config(config)
    backends = data.get("backends") or {}
    key = next((name for name, cfg in backends.items()
                if backend == name or backend in (cfg or {}).get("aliases", [])), None)
    if key is None:
        raise ConfigError(f"--backend {backend!r} is not in {config} (backends: {', '.join(backends)})")
    if prompt:
        backends[key]["prompt"] = prompt
    for item in sampling:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--sampling {item!r}: expected NAME=VALUE, e.g. temperature=0.2")
        backends[key].setdefault("sampling", {})[name] = yaml.safe_load(value)
    proxy = data.setdefault("proxy", {})
    if frame_store is not None:
        proxy["frame_store"] = {**(proxy.get("frame_store") or {}), "dir": str(frame_store.resolve())}
    if not proxy.get("frame_store"):
        raise ConfigError("no frame store: give --frame-store DIR or set proxy.frame_store in the config")
    proxy["audit_log"] = str(out.resolve())
    settings = settings_from_dict(data, base_dir=config.parent.resolve(), source=str(config))
    return settings, key, settings.proxy.frame_store.dir


def _audit_lines(path: Path, tally: ReplayTally, from_backend: str | None) -> Iterator[tuple[int, dict]]:
    for number, line, _why in audit_records(path):
        if line is None:
            tally.skipped["malformed line"] += 1
        elif line.get("kind", "score") != "score":
            tally.skipped[f"{line.get('kind')} line"] += 1  # /compare lines are not episodes to score
        elif not from_backend or line.get("backend") == from_backend:
            yield number, line


REPLAY_CARRIES = ("score_mode", "constrain", "samples", "reduce", "quorum", "logprob_score")


def episode_request(line: dict, store: Path, backend: str, number: int = 0) -> dict | str:
    """The /score body that shows vLLM the stored frames again, or why it cannot be built."""
    frames = line.get("frames") or {}
    hashes = frames.get("sha256") or []
    if not hashes or not line.get("task_text"):
        return "no frames recorded"
    if frames.get("extra_view"):  # the store holds both views, but a replay rebuilds one
        return "a second camera (not replayed yet)"
    try:
        jpegs = [frame_path(store, digest).read_bytes() for digest in hashes]
    except (OSError, ValueError):
        return "frame missing from the store"
    metadata = dict(line.get("metadata") or {})
    # replay_of_line: `report --compare` matches each replayed episode to exactly its line
    metadata.update({"replay_of_backend": line.get("backend"), "replay_of_ts": line.get("ts"),
                     "replay_of_score": line.get("score"), "replay_of_line": number})
    body: dict[str, Any] = {"task_text": line["task_text"], "backend": backend, "nframes": len(jpegs),
                            "frames": [base64.b64encode(j).decode("ascii") for j in jpegs], "metadata": metadata}
    if frames.get("fps"):
        body["video_fps"] = frames["fps"]  # the rate vLLM was told the first time
    if frames.get("sampled_fps"):
        body["fps"] = frames["sampled_fps"]  # the frames' real rate (presentation_fps: episode)
    asked = line.get("asked") or {}
    if asked.get("max_pixels"):
        body["max_pixels"] = asked["max_pixels"]
    # the scale and the estimator travel; sampling and prompt text are what a replay changes
    kwargs = asked.get("backend_kwargs") or {}
    carried = {k: v for k, v in kwargs.items() if k in REPLAY_CARRIES}
    if carried.get("samples", 1) != 1 and "temperature" in kwargs:  # k samples: at the temperature asked
        carried["temperature"] = kwargs["temperature"]
    if carried:
        body["backend_kwargs"] = carried
    return body


async def replay(settings: Any, backend: str, store: Path, audit: Path, *, concurrency: int,
                 from_backend: str | None = None, limit: int | None = None,
                 progress=None) -> ReplayTally:
    import httpx

    from proxy.http.app import create_app

    app = create_app(settings)
    tally = ReplayTally()
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()

    async def one(http: httpx.AsyncClient, body: dict) -> None:
        try:
            response = await http.post(SCORE_PATH, json=body)
            if response.status_code == 200:
                tally.scored += 1
            else:
                tally.failed[_error_code(response)] += 1
        except httpx.HTTPError as err:
            tally.failed[type(err).__name__] += 1
        finally:
            slots.release()
            if progress:
                progress(tally)

    key = settings.proxy_api_key()
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://replay", timeout=None, headers=headers) as http:
        for number, line in _audit_lines(audit, tally, from_backend):
            if limit is not None and tally.sent >= limit:
                break
            body = await asyncio.to_thread(episode_request, line, store, backend, number)
            if isinstance(body, str):
                tally.skipped[body] += 1
                continue
            await slots.acquire()  # at most `concurrency` episodes (and their frames) in memory
            tally.sent += 1
            task = asyncio.create_task(one(http, body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    return tally


def _error_code(response) -> str:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return f"http_{response.status_code}"


def _progress():
    line = ProgressLine("replay")
    return lambda tally: line(tally.scored + sum(tally.failed.values()), tally.line(), total=tally.sent)


def _run(args: argparse.Namespace) -> int:
    audit, out = Path(args.audit), Path(args.out_file)
    inputs = {part.resolve() for part in audit_files(audit)}  # the file, or its rotated parts (reports/audit_lines.py)
    if not inputs:
        raise ConfigError(f"audit log {audit} does not exist")
    existing = audit_files(out)
    if args.force and args.append:
        raise ConfigError("--force overwrites --out-file, --append adds to it: give one")
    if existing and inputs & {part.resolve() for part in existing}:
        raise ConfigError(f"--out-file {out} is the audit log being replayed; choose another file")
    if existing and not (args.force or args.append):
        raise ConfigError(f"{out} exists; choose another --out-file, or pass --force to overwrite it "
                          "or --append to add to it")
    settings, backend, store = replay_settings(Path(args.config), args.backend, out, args.prompt, args.sampling,
                                               Path(args.frame_store) if args.frame_store else None)
    if args.force:
        for part in existing:  # its rotated parts too: `report` would read them as part of the log
            part.unlink()
    tally = asyncio.run(replay(settings, backend, store, audit, concurrency=args.concurrency,
                               from_backend=args.from_backend, limit=args.limit, progress=_progress()))
    print(f"\nreplay of {audit} on {backend} into {out}: {tally.line()}")
    print(f"compare: vlm-reward-proxy report {audit} --compare {out} --out DIR")
    return 0 if tally.sent and not tally.failed else 1


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:  # a Semaphore(0) would wait forever
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def add_subcommand(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "replay", help="re-score an audit log's stored episodes with another prompt, backend or sampling",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("audit", metavar="AUDIT.jsonl", help="the audit log to replay")
    parser.add_argument("--config", required=True, metavar="FILE", help="proxy config (backends, prompts)")
    parser.add_argument("--backend", required=True, metavar="NAME", help="backend (name or alias) that re-scores")
    parser.add_argument("--prompt", metavar="NAME",
                        help="template name in the prompts dir to use instead of the backend's")
    parser.add_argument("--sampling", action="append", default=[], metavar="NAME=VALUE",
                        help="override one sampling setting, e.g. temperature=0.2 (repeatable)")
    parser.add_argument("--frame-store", metavar="DIR", help="default: proxy.frame_store.dir of the config")
    parser.add_argument("--from-backend", metavar="NAME", help="replay only the lines this backend scored")
    parser.add_argument("--limit", type=int, metavar="N", help="replay at most N episodes")
    parser.add_argument("--concurrency", type=_at_least_one, default=8, metavar="N",
                        help="episodes in flight (default 8)")
    parser.add_argument("--out-file", required=True, metavar="NEW.jsonl",
                        help="the new audit log (a file; --out elsewhere names a folder)")
    parser.add_argument("--force", action="store_true", help="overwrite --out-file if it exists")
    parser.add_argument("--append", action="store_true", help="add to --out-file if it exists")
    parser.set_defaults(func=_run)
