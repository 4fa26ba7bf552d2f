"""`vlm-reward-proxy eval EPISODES --config FILE --backend A [--backend B ...] --out DIR`: score a set
of episodes with known outcomes with each candidate reward (a backend: template, layout, estimator)
and its negative controls, and write DIR/eval.html and DIR/eval.json: which method ranks first on
what (the numbers: reports/method_eval.py).

EPISODES is a directory holding `episodes.jsonl`, one line per episode (or `--audit AUDIT.jsonl
--frame-store DIR`: a run's own scored episodes that carry metadata.env_success, their frames the
JPEGs vLLM received):

    {"file": "ep0001.mp4", "task_text": "put the bowl on the plate", "task_id": 3, "success": true}

`file` (relative to the directory) is an MP4 or a T×H×W×3 uint8 `.npy`. Each episode is scored by
each backend through the proxy's own pipeline (the app runs in this process, as for `replay`):
ONE POST /score/dense per episode and backend gives the dense curve (`--points` prefixes, or one
shuffled call on a GVL backend) and, as its last point, the episode's score. The controls are the
same call on the episode reversed, its frames shuffled (seeded), and with another task's
instruction. Episodes longer than MAX_FRAMES frames are sampled evenly down to it first (a curve
and a score only ever see sampled frames), and frames larger than the backends' largest
`frames.max_pixels` are scaled down to it (they resize to it anyway; the body cap stays far).
The app's audit log goes to DIR/audit.jsonl: `vlm-reward-proxy report` reads it too.

A cascade named by --backend is not a method of its own: each of its stages scores each episode
with ONE POST /score, and its cost–quality frontier is replayed from those scores offline
(vlm_reward_cli/eval_cascade.py, reports/cascade_frontier.py; no controls).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.answers.per_frame import shuffle_order
from proxy.errors import ConfigError
from reports.method_eval import CONTROLS
from vlm_protocol.frames import sample_indices
from vlm_protocol.wire import DENSE_PATH
from vlm_reward_cli.eval_cascade import add_cascade_arguments, cascade_arguments
from vlm_reward_cli.progress import ProgressLine

__all__ = ["Episode", "add_subcommand", "evaluate", "load_episodes"]

MAX_FRAMES = 128
MAX_READ = 4096  # frames of a video whose header gives no count (all are read, then sampled)


@dataclass(frozen=True)
class Episode:
    index: int
    file: Path | tuple[Path, ...]  # an MP4 or .npy, or the stored JPEGs of an audit line, in order
    task_text: str
    task_id: Any
    success: bool

    @property
    def name(self) -> str:
        return self.file.name if isinstance(self.file, Path) else f"audit line {self.index}"


def load_episodes(directory: Path) -> list[Episode]:
    listing = directory / "episodes.jsonl"
    if not listing.is_file():
        raise ConfigError(f"{listing} does not exist: an episodes directory lists its episodes there, one JSON "
                          'line each: {"file": ..., "task_text": ..., "task_id": ..., "success": true|false}')
    episodes = []
    for number, line in enumerate(listing.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            file, task, success = item["file"], item["task_text"], item["success"]
            if not (isinstance(file, str) and isinstance(task, str) and task.strip() and isinstance(success, bool)):
                raise TypeError("file and task_text must be strings, success true or false")
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{listing}:{number}: {type(err).__name__}: {err}") from None
        path = (directory / file).resolve()
        if not path.is_relative_to(directory.resolve()) or not path.is_file():
            raise ConfigError(f"{listing}:{number}: {file!r} is not a file inside {directory}")
        episodes.append(Episode(len(episodes), path, task, item.get("task_id", task), success))
    if not episodes:
        raise ConfigError(f"{listing} lists no episode")
    return episodes


def audit_episodes(audit: Path, store: Path, limit: int | None = None) -> list[Episode]:
    """The scored episodes of an audit log that carry env_success, with their frames in the frame
    store (the JPEGs vLLM received): a training run's own episodes as an eval set."""
    from reports.audit_lines import audit_records
    from vlm_protocol.frame_store import frame_path

    episodes: list[Episode] = []
    for _number, line, _why in audit_records(audit):
        if limit is not None and len(episodes) >= limit:
            break
        if not line or line.get("kind", "score") != "score" or "score" not in line:
            continue
        metadata, hashes = line.get("metadata") or {}, (line.get("frames") or {}).get("sha256") or []
        if not isinstance(metadata.get("env_success"), bool) or len(hashes) < 2 or not line.get("task_text"):
            continue
        if (line.get("frames") or {}).get("extra_view"):  # two cameras: one view (or the composed frames) is
            continue                                      # not that episode; eval rebuilds one camera only
        try:
            paths = tuple(frame_path(store, digest) for digest in hashes)
        except ValueError:
            continue
        if all(path.is_file() for path in paths):
            episodes.append(Episode(len(episodes), paths, line["task_text"],
                                    metadata.get("task_id", line["task_text"]), metadata["env_success"]))
    if not episodes:
        raise ConfigError(f"{audit}: no scored episode with metadata.env_success whose frames are in {store}")
    return episodes


def read_frames(path: Path | tuple[Path, ...]) -> Any:
    """The episode's frames, T×H×W×3 uint8 RGB, sampled evenly down to MAX_FRAMES."""
    import numpy as np

    if isinstance(path, tuple):  # stored JPEGs
        import cv2

        decoded = [cv2.imdecode(np.frombuffer(p.read_bytes(), np.uint8), cv2.IMREAD_COLOR) for p in path]
        if any(image is None for image in decoded) or len({image.shape for image in decoded}) != 1:
            raise ConfigError(f"stored frames {path[0].parent}/...: not JPEGs of one size")
        frames = np.stack([cv2.cvtColor(image, cv2.COLOR_BGR2RGB) for image in decoded])
    elif path.suffix == ".npy":
        frames = np.load(path, mmap_mode="r", allow_pickle=False)  # only the frames kept are read
    else:
        import cv2

        capture, frames = cv2.VideoCapture(str(path)), []
        try:
            # only the frames kept are held: a long video never sits whole in memory
            count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
            keep = set(sample_indices(count, MAX_FRAMES)) if count > MAX_FRAMES else None
            index = 0
            while True:
                ok, bgr = capture.read()
                if not ok:
                    break
                if keep is None or index in keep:
                    frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
                index += 1
                if keep is None and len(frames) > MAX_READ:
                    raise ConfigError(f"{path}: more than {MAX_READ} frames and no frame count in its header")
        finally:
            capture.release()
        frames = np.stack(frames) if frames else np.empty((0, 0, 0, 3), np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) < 2:
        where = path if isinstance(path, Path) else path[0].parent
        raise ConfigError(f"{where}: expected at least 2 frames, T×H×W×3 uint8 RGB; got {frames.dtype} {frames.shape}")
    return np.ascontiguousarray(frames[sample_indices(len(frames), MAX_FRAMES)] if len(frames) > MAX_FRAMES
                                else frames)


def fit_pixels(frames: Any, max_pixels: int) -> Any:
    """The frames scaled down (INTER_AREA) to at most `max_pixels` each: the backends resize to their
    own budget anyway, and a full-resolution episode would pass the body cap (proxy.max_body_mb)."""
    height, width = frames.shape[1:3]
    if height * width <= max_pixels:
        return frames
    import cv2
    import numpy as np

    scale = (max_pixels / (height * width)) ** 0.5
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    return np.stack([cv2.resize(frame, size, interpolation=cv2.INTER_AREA) for frame in frames])


def _npy_b64(frames: Any) -> str:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(frames), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _variants(episode: Episode, frames: Any, episodes: list[Episode], controls: tuple[str, ...], seed: int
              ) -> list[tuple[str | None, str, Any]]:
    """(control or None, task text, frames) to score for one episode."""
    out: list[tuple[str | None, str, Any]] = [(None, episode.task_text, frames)]
    if "reversed" in controls:
        out.append(("reversed", episode.task_text, frames[::-1]))
    if "shuffled" in controls:
        order = shuffle_order(len(frames), seed * 1_000_003 + episode.index).order
        out.append(("shuffled", episode.task_text, frames[list(order)]))
    others = sorted({e.task_text for e in episodes} - {episode.task_text})
    if "instruction" in controls and others:
        out.append(("instruction", others[episode.index % len(others)], frames))
    return out


async def evaluate(settings: Any, episodes: list[Episode], backends: list[str], *, points: int,
                   controls: tuple[str, ...], concurrency: int, seed: int = 0, progress=None,
                   stages: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One record per (episode, backend, control): score, curve, cost, or the error; and one per
    (episode, stage backend of a cascade): its one /score (vlm_reward_cli/eval_cascade.py)."""
    import httpx

    from proxy.http.app import create_app
    from vlm_reward_cli.eval_cascade import score_stage

    app = create_app(settings)
    records: list[dict[str, Any]] = []
    stage_records: list[dict[str, Any]] = []
    slots = asyncio.Semaphore(concurrency)
    key = settings.proxy_api_key()
    headers = {"authorization": f"Bearer {key}"} if key else {}

    async def one(http: httpx.AsyncClient, episode: Episode, backend: str, control: str | None, task: str,
                  frames_b64: str) -> None:
        record: dict[str, Any] = {"episode": episode.index, "file": episode.name, "task_id": episode.task_id,
                                  "success": episode.success, "method": backend, "control": control}
        metadata = {"run": f"eval:{control or 'episode'}", "episode_id": episode.index,
                    "task_id": str(episode.task_id)[:256], **({"env_success": episode.success} if not control else {})}
        # every variant is the original's call (a GVL backend shows the same frames), only what it shows changes
        body: dict[str, Any] = {"task_text": task, "backend": backend, "frames_npy": frames_b64, "metadata": metadata,
                                "points": points}
        started = time.perf_counter()
        async with slots:
            try:
                answer = await http.post(DENSE_PATH, json=body)
                result = answer.json()
            except (httpx.HTTPError, ValueError) as err:
                answer, result = None, {"error": {"code": type(err).__name__}}
        seconds = time.perf_counter() - started
        record["cost"] = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "seconds": seconds}
        if answer is None or answer.status_code != 200:
            record["error"] = (result.get("error") or {}).get("code", f"http_{getattr(answer, 'status_code', 0)}")
        else:
            usage = result.get("usage") or {}
            record.update(score=result["curve"][-1]["score"], curve=[p["score"] for p in result["curve"]],
                          curve_method=result.get("method"),
                          cost={"calls": result["attempts"], "prompt_tokens": usage.get("prompt_tokens", 0),
                                "completion_tokens": usage.get("completion_tokens", 0), "seconds": seconds})
        # (a failed call's seconds count too: a method that fails is not cheaper for it)
        records.append(record)
        if progress:
            progress(len(records))

    async def stage(http: httpx.AsyncClient, episode: Episode, backend: str, frames_b64: str) -> None:
        async with slots:
            stage_records.append(await score_stage(http, episode, backend, frames_b64))
        if progress:
            progress(len(records) + len(stage_records))

    max_pixels = max(settings.backends[b].frames.max_pixels for b in (*backends, *stages))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://eval", timeout=None, headers=headers) as http:
        for episode in episodes:
            frames = await asyncio.to_thread(fit_pixels, await asyncio.to_thread(read_frames, episode.file), max_pixels)
            calls = []
            for control, task, variant in _variants(episode, frames, episodes, controls, seed):
                frames_b64 = await asyncio.to_thread(_npy_b64, variant)
                calls += [one(http, episode, backend, control, task, frames_b64) for backend in backends]
                if control is None:
                    calls += [stage(http, episode, backend, frames_b64) for backend in stages]
            await asyncio.gather(*calls)  # one episode's frames in memory at a time
    return (sorted(records, key=lambda r: (r["episode"], r["method"], r["control"] or "")),
            sorted(stage_records, key=lambda r: (r["episode"], r["stage"])))


def _settings(config: Path, backends: list[str], out: Path) -> tuple[Any, list[str], list[str]]:
    """The settings, the backends named (by name) and the cascades named (by name)."""
    from proxy.config import read_config, settings_from_dict

    data = read_config(config)
    known, cascades = data.get("backends") or {}, data.get("cascades") or {}
    names, cascade_names = [], []
    for backend in backends:
        name = next((n for n, cfg in known.items() if backend == n or backend in (cfg or {}).get("aliases", [])), None)
        cascade = next((n for n, cfg in cascades.items() if backend == n or backend in (cfg or {}).get("aliases", [])),
                       None)
        if name is None and cascade is None:
            raise ConfigError(f"--backend {backend!r} is not in {config} (backends: {', '.join(known)}"
                              + (f"; cascades: {', '.join(cascades)})" if cascades else ")"))
        if name is not None:
            names.append(name)
        else:
            cascade_names.append(cascade)
    proxy = data.setdefault("proxy", {})
    proxy["audit_log"] = str((out / "audit.jsonl").resolve())
    return settings_from_dict(data, base_dir=config.parent.resolve(), source=str(config)), names, cascade_names


def _run(args: argparse.Namespace) -> int:
    from reports.method_eval import method_numbers, rank, render_eval
    from vlm_reward_cli.eval_cascade import cascade_frontiers, cascade_spec

    out = Path(args.out)
    if (args.episodes is None) == (args.audit is None) or (args.audit is None) != (args.frame_store is None):
        raise ConfigError("give an episodes directory, or --audit AUDIT.jsonl with --frame-store DIR")
    if args.audit is not None:
        source = f"{args.audit} (frames from {args.frame_store})"
        episodes = audit_episodes(Path(args.audit), Path(args.frame_store), args.limit)
    else:
        source = args.episodes
        episodes = load_episodes(Path(args.episodes))[: args.limit]
    controls = tuple(c for c in args.controls.split(",") if c) if args.controls != "none" else ()
    unknown = sorted(set(controls) - set(CONTROLS))
    if unknown:
        raise ConfigError(f"--controls: unknown {', '.join(unknown)}; choose from {', '.join(CONTROLS)} or none")
    bands = cascade_arguments(args)
    out.mkdir(parents=True, exist_ok=True)
    settings, backends, cascades = _settings(Path(args.config), args.backend, out)
    stages = tuple(dict.fromkeys(s["backend"] for c in cascades for s in cascade_spec(settings, c)["stages"]))
    total = len(episodes) * (len(backends) * (1 + len(controls)) + len(stages))
    records, stage_records = asyncio.run(evaluate(
        settings, episodes, backends, points=args.points, controls=controls, concurrency=args.concurrency,
        seed=args.seed, progress=ProgressLine("eval", total), stages=stages))
    numbers = method_numbers(records)
    frontiers = cascade_frontiers(settings, cascades, stage_records, prefill_tps=args.prefill_tps,
                                  decode_tps=args.decode_tps, max_auc_loss=args.max_auc_loss,
                                  draws=args.random_draws, seed=args.seed, bands=bands)
    result = {"episodes_source": source, "episodes": len(episodes),
              "successes": sum(e.success for e in episodes), "points": args.points, "controls": list(controls),
              "methods": numbers, "ranks_first": rank(numbers), "records": records,
              "cascades": frontiers, "cascade_records": stage_records}
    (out / "eval.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    page = render_eval(out, result)
    failed = sum(1 for r in records if r.get("error")) + sum(1 for r in stage_records if r.get("error"))
    print(f"\neval: {len(episodes)} episodes × {len(backends)} method(s) and {len(cascades)} cascade(s), "
          f"{len(records) + len(stage_records)} calls' records, {failed} failed; {page}")
    for key, method in result["ranks_first"].items() if backends else ():
        print(f"  first on {key}: {method or '—'}")
    for name, frontier in frontiers.items():
        print(f"  cascade {name}: cheapest within {args.max_auc_loss:g} AUC of {frontier.get('reference', '—')}: "
              f"{frontier.get('cheapest_within_loss') or '—'}")
    return 0 if not failed else 1


DESCRIPTION = """\
Score episodes whose outcome is known with each candidate reward (a backend: template, layout,
estimator) and with negative controls (the episode reversed, its frames shuffled, another task's
instruction), through the proxy's own pipeline in this process, and write eval.html, eval.json
and audit.jsonl into the --out folder: which method ranks first on what (AUC, VOC, controls, cost).

EPISODES_DIR holds the episode files and episodes.jsonl, one JSON line per episode: the file
(relative to the directory; an MP4 or a TxHxWx3 uint8 .npy), the instruction, a task id, and
whether the episode succeeded (the simulator's outcome, the ground truth):

  {"file": "ep0001.mp4", "task_text": "put the bowl on the plate", "task_id": 3, "success": true}

Instead of a directory, --audit with --frame-store takes a run's own scored episodes that carry
metadata.env_success, their frames the JPEGs vLLM received."""


def add_subcommand(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval", help="compare candidate rewards on episodes with known outcomes (AUC, VOC, controls, cost)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("episodes", metavar="EPISODES_DIR", nargs="?",
                        help="a directory with episodes.jsonl and the files (or --audit with --frame-store)")
    parser.add_argument("--audit", metavar="AUDIT.jsonl", help="take the episodes of an audit log that carry "
                        "metadata.env_success, their frames from --frame-store (the JPEGs vLLM received)")
    parser.add_argument("--frame-store", metavar="DIR", help="the frame store of --audit")
    parser.add_argument("--config", required=True, metavar="FILE", help="proxy config (backends, prompts)")
    parser.add_argument("--backend", action="append", required=True, metavar="NAME",
                        help="a backend (name or alias) to evaluate (repeatable: one per method); a cascade's name "
                             "scores each of its stages once per episode and draws its cost-quality frontier")
    parser.add_argument("--points", type=int, default=8, metavar="N", help="points per dense curve (default 8)")
    parser.add_argument("--controls", default=",".join(CONTROLS), metavar="LIST",
                        help=f"comma-separated, of {', '.join(CONTROLS)}; or none (default: all)")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="the shuffled control's seed (default 0)")
    parser.add_argument("--limit", type=int, metavar="N", help="evaluate at most N episodes")
    parser.add_argument("--concurrency", type=int, default=8, metavar="N", help="calls in flight (default 8)")
    add_cascade_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="where eval.html, eval.json, audit.jsonl go")
    parser.set_defaults(func=_run)
