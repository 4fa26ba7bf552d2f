"""`eval --backend CASCADE`: every stage of a cascade scores every episode once, and the cascade's
cost–quality frontier is replayed from those scores offline (reports/cascade_frontier.py).

Each stage is a backend of the config, so each episode gets ONE POST /score per stage backend
through the proxy's own pipeline (the app runs in this process, as for the other methods). The
stages make their frames alike (the config refuses a cascade whose stages' frame settings
differ), so a stage scored directly sees what it would see inside the cascade. The audit's draw
per stage is the proxy's own rule (proxy.pipelines.cascade_state.audit_draw) on the identity the
cascade gives an episode sent with metadata.episode_id = its index, so the replay audits the
episodes the live cascade would. A stage that fails an episode leaves the episode out of the
frontier (counted as failed; eval exits 1).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from proxy.errors import ConfigError
from reports.cascade_frontier import CostModel, band_grid, frontier
from vlm_protocol.wire import SCORE_PATH

__all__ = ["DEFAULT_DECODE_TPS", "DEFAULT_PREFILL_TPS", "add_cascade_arguments", "cascade_arguments",
           "cascade_frontiers", "cascade_spec", "score_stage"]

# The cost model's defaults, for a 7B vision-language model on one H100 serving many episodes at
# once (bf16, vLLM). Both are estimates, the same ones docs/rlinf.md sizes runs B and C with:
# prefill: Qwen2.5-VL-7B's measured ~15 episodes/s per H100 at 1154 vision + ~137 text tokens
# (issue 28's figure), i.e. about 19,400 prompt tokens/s; decode: 4,000 tokens/s per GPU.
DEFAULT_PREFILL_TPS = 19_400.0
DEFAULT_DECODE_TPS = 4_000.0
COST_SOURCE = ("the defaults estimate a 7B VLM on one H100: prefill from Qwen2.5-VL-7B's measured ~15 episodes/s "
               "at ~1291 prompt tokens, decode the 4,000 tokens/s docs/rlinf.md assumes; set --prefill-tps and "
               "--decode-tps for your GPUs")
RUN = "eval:cascade"


def cascade_spec(settings: Any, name: str) -> dict[str, Any]:
    """The cascade's config as the pure replay reads it, its stages by backend name (aliases resolved)."""
    config = settings.cascades[name]
    labels = {label: backend for backend, cfg in settings.backends.items() for label in (backend, *cfg.aliases)}
    return {"threshold": config.threshold, "max_escalated_fraction": config.max_escalated_fraction,
            "stages": [{"backend": labels[s.backend], "band": None if s.band is None else list(s.band),
                        "audit_fraction": s.audit_fraction, "disagree": s.disagree} for s in config.stages]}


async def score_stage(http: Any, episode: Any, backend: str, frames_b64: str) -> dict[str, Any]:
    """One stage backend's /score of one episode: its score, usage, calls and seconds, or its error."""
    import httpx

    record: dict[str, Any] = {"episode": episode.index, "task_id": episode.task_id, "success": episode.success,
                              "stage": backend}
    body = {"task_text": episode.task_text, "backend": backend, "frames_npy": frames_b64,
            "metadata": {"run": RUN, "episode_id": episode.index, "task_id": str(episode.task_id)[:256],
                         "env_success": episode.success}}
    started = time.perf_counter()
    try:
        answer = await http.post(SCORE_PATH, json=body)
        result = answer.json()
    except (httpx.HTTPError, ValueError) as err:
        answer, result = None, {"error": {"code": type(err).__name__}}
    record["wall_seconds"] = time.perf_counter() - started
    if answer is None or answer.status_code != 200:
        record["error"] = (result.get("error") or {}).get("code", f"http_{getattr(answer, 'status_code', 0)}")
        return record
    usage = result.get("usage") or {}
    record.update(score=result["score"], calls=result["attempts"], prompt_tokens=usage.get("prompt_tokens", 0),
                  completion_tokens=usage.get("completion_tokens", 0),
                  seconds=result["timings_ms"]["total"] / 1e3)
    return record


def cascade_frontiers(settings: Any, cascades: list[str], records: list[dict[str, Any]], *, prefill_tps: float,
                      decode_tps: float, max_auc_loss: float, draws: int, seed: int,
                      bands: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """cascade → its frontier (reports/cascade_frontier.frontier) over the episodes every stage scored."""
    from proxy.pipelines.cascade_state import audit_draw

    model = CostModel(prefill_tps, decode_tps, COST_SOURCE if (prefill_tps, decode_tps) == (
        DEFAULT_PREFILL_TPS, DEFAULT_DECODE_TPS) else "set on the command line")
    by_key = {(r["episode"], r["stage"]): r for r in records}
    out = {}
    for name in cascades:
        spec = cascade_spec(settings, name)
        stages = [s["backend"] for s in spec["stages"]]
        numbers = sorted({r["episode"] for r in records})
        episodes, failed = [], []
        for number in numbers:
            mine = [by_key.get((number, stage)) for stage in stages]
            if any(r is None or r.get("error") for r in mine):
                failed.append(number)
                continue
            episodes.append({"episode": number, "success": mine[0]["success"], "stages": mine,
                             "audit_draws": [audit_draw(f"{name}|{index}|episode:{number}")
                                             for index in range(len(stages))]})
        result: dict[str, Any] = {"failed_episodes": failed, "spec": spec}
        if episodes:
            result |= frontier(episodes, spec, model, bands=band_grid(spec["stages"][0]["band"], spec["threshold"],
                                                                      extra=bands or ()),
                               max_auc_loss=max_auc_loss, draws=draws, seed=seed)
        out[name] = result
    return out


def add_cascade_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-tps", type=float, default=DEFAULT_PREFILL_TPS, metavar="N",
                        help="a cascade's cost model: prompt tokens per second one GPU prefills (default "
                             f"{DEFAULT_PREFILL_TPS:,.0f}: an estimate for a 7B VLM on an H100, docs/cascades.md)")
    parser.add_argument("--decode-tps", type=float, default=DEFAULT_DECODE_TPS, metavar="N",
                        help="a cascade's cost model: completion tokens per second one GPU decodes across the "
                             f"requests it serves (default {DEFAULT_DECODE_TPS:,.0f}: an estimate, docs/cascades.md)")
    parser.add_argument("--max-auc-loss", type=float, default=0.01, metavar="X",
                        help="name the cheapest band whose AUC is within X of the last stage alone (default 0.01)")
    parser.add_argument("--random-draws", type=int, default=200, metavar="N",
                        help="draws of random escalation at each band's rate, averaged (default 200; --seed seeds)")
    parser.add_argument("--bands", metavar="LIST", help="comma-separated LO:HI bands to replay beside the "
                        "grid around a cascade's configured band (e.g. 0.45:0.55,0.2:0.8)")


def cascade_arguments(args: argparse.Namespace) -> list[tuple[float, float]]:
    """The cascade options checked; the extra bands of --bands."""
    if args.prefill_tps <= 0 or args.decode_tps <= 0 or args.max_auc_loss < 0 or args.random_draws < 1:
        raise ConfigError("--prefill-tps and --decode-tps must be above 0, --max-auc-loss at least 0, "
                          "--random-draws at least 1")
    return _bands(args.bands)


def _bands(text: str | None) -> list[tuple[float, float]]:
    """--bands "0.4:0.6,0.2:0.8": bands replayed beside the grid."""
    bands = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        try:
            lo, hi = (float(v) for v in part.split(":"))
        except ValueError:
            raise ConfigError(f"--bands: {part!r} is not LO:HI") from None
        if not 0.0 <= lo <= hi <= 1.0:
            raise ConfigError(f"--bands: {part!r} needs 0 <= LO <= HI <= 1")
        bands.append((lo, hi))
    return bands
