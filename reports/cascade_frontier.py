"""A cascade's cost–quality frontier for `vlm-reward-proxy eval`: every stage scored every episode
once (vlm_reward_cli/evaluate.py collects that), and the policies are replayed here offline, with
no further call:

    stage alone      each stage's own score on every episode
    cascade band     the cascade as configured, its first stage's band replaced by each band of a
                     grid around the configured one (the configured band included, and [0, 1]:
                     every episode goes on); audits, disagreement and the budget as configured
    random           the same number of episodes sent on as a cascade band sent, chosen uniformly
                     at random (seeded), averaged over draws: the baseline a router must beat

Per policy: ROC-AUC against success, accuracy at the cascade's threshold, the escalated fraction
(episodes on which any stage after the first ran), calls, prompt and completion tokens, and
GPU-seconds per episode, estimated by a stated cost model (prompt tokens at a prefill rate plus
completion tokens at a decode rate: a one-token P(done) still pays its whole prefill), beside the
seconds measured on the server the eval ran against.

Invariants: the replay asks each stage the same question the live cascade would (proxy/pipelines/
cascade.py: the band on the stage's score, disagreement across the threshold with the stage
before, the hashed audit draw the collection computed with the proxy's own rule); the budget is
applied as if the eval's episodes were one /score/batch (the closest to the threshold go on
first, audits outside it); a random policy escalates straight to the last stage. Pure: records
in, numbers and HTML out.
"""

from __future__ import annotations

import html
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reports.plotting import fmt, table
from vlm_protocol.agreement import roc_auc

__all__ = ["DEFAULT_BAND_SCALES", "CostModel", "band_grid", "frontier", "frontier_section", "replay"]

# The grid of bands: the configured band's distances below and above the threshold, times each
# factor (1: the configured band). None is no band (only audits and disagreement go on); the full
# band [0, 1] is always added, so the last stage's own quality is always on the frontier.
DEFAULT_BAND_SCALES = (None, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
DEFAULT_HALF_WIDTH = 0.2  # a stage configured without a band: the grid's unit band is threshold ± this


@dataclass(frozen=True)
class CostModel:
    """GPU-seconds of one call = prompt tokens / prefill_tps + completion tokens / decode_tps, on one
    GPU serving many episodes at once (throughputs, not one request's latency). An estimate: the
    defaults and where they come from are in docs/cascades.md and `eval --help`."""

    prefill_tps: float
    decode_tps: float
    source: str = ""

    def seconds(self, prompt_tokens: float, completion_tokens: float) -> float:
        return prompt_tokens / self.prefill_tps + completion_tokens / self.decode_tps


def band_grid(configured: Sequence[float] | None, threshold: float,
              scales: Sequence[float | None] = DEFAULT_BAND_SCALES,
              extra: Sequence[Sequence[float]] = ()) -> list[tuple[float, float] | None]:
    """The bands to replay, narrowest first: the configured one, a grid around it, [0, 1], `extra`."""
    lo, hi = configured if configured is not None else (threshold - DEFAULT_HALF_WIDTH,
                                                        threshold + DEFAULT_HALF_WIDTH)
    below, above = max(threshold - lo, 0.0), max(hi - threshold, 0.0)
    bands: list[tuple[float, float] | None] = []
    for scale in scales:
        band = None if scale is None else (round(max(0.0, threshold - scale * below), 6),
                                           round(min(1.0, threshold + scale * above), 6))
        bands.append(band)
    bands += [tuple(configured) if configured is not None else None, (0.0, 1.0), *(tuple(b) for b in extra)]
    unique = list(dict.fromkeys(bands))
    return sorted(unique, key=lambda b: -1.0 if b is None else b[1] - b[0])


def _stage_cost(stage: dict[str, Any], model: CostModel) -> dict[str, float]:
    return {"calls": stage["calls"], "prompt_tokens": stage["prompt_tokens"],
            "completion_tokens": stage["completion_tokens"], "seconds": stage["seconds"],
            "gpu_seconds": model.seconds(stage["prompt_tokens"], stage["completion_tokens"])}


def replay(episodes: list[dict[str, Any]], cascade: dict[str, Any], band: tuple[float, float] | None | str = "config"
           ) -> list[list[int]]:
    """For each episode, the indices of the stages the cascade runs, with the first stage's band
    replaced by `band` ("config": as configured). An episode is {"success", "stages": [{"score", ...}
    per stage], "audit_draws": [one number in [0, 1) per stage]}."""
    stages, threshold = cascade["stages"], cascade["threshold"]
    cap = int(cascade.get("max_escalated_fraction", 1.0) * len(episodes) + 1e-9)
    ran = [[0] for _ in episodes]
    for index, stage in enumerate(stages[:-1]):
        stage_band = (tuple(stage["band"]) if stage.get("band") is not None else None) \
            if index > 0 or band == "config" else band
        doubt: list[tuple[float, int]] = []
        audited: list[int] = []
        for number, episode in enumerate(episodes):
            if ran[number][-1] != index:  # stopped at an earlier stage
                continue
            score = episode["stages"][index]["score"]
            in_band = stage_band is not None and stage_band[0] <= score <= stage_band[1]
            disagrees = bool(stage.get("disagree")) and index > 0 and (
                (episode["stages"][index - 1]["score"] >= threshold) != (score >= threshold))
            if in_band or disagrees:
                doubt.append((abs(score - threshold), number))
            elif episode["audit_draws"][index] < stage.get("audit_fraction", 0.0):
                audited.append(number)
        went_on = [number for _, number in sorted(doubt)[:cap]] + audited
        for number in went_on:
            ran[number].append(index + 1)
    return ran


def _numbers(name: str, kind: str, scores: list[float], successes: list[bool], escalated: float,
             costs: list[dict[str, float]], threshold: float, **extra: Any) -> dict[str, Any]:
    n = len(scores)

    def per_episode(key: str) -> float:
        return sum(c[key] for c in costs) / n

    return {"policy": name, "kind": kind, "auc": roc_auc(scores, successes),
            "accuracy": sum((s >= threshold) == y for s, y in zip(scores, successes, strict=True)) / n,
            "escalated_fraction": escalated, "calls_per_episode": per_episode("calls"),
            "prompt_tokens_per_episode": per_episode("prompt_tokens"),
            "completion_tokens_per_episode": per_episode("completion_tokens"),
            "gpu_seconds_per_episode": per_episode("gpu_seconds"),
            "measured_seconds_per_episode": per_episode("seconds"), **extra}


def _band_name(band: tuple[float, float] | None) -> str:
    return "no band" if band is None else f"[{band[0]:g}, {band[1]:g}]"


def frontier(episodes: list[dict[str, Any]], cascade: dict[str, Any], model: CostModel, *,
             bands: list[tuple[float, float] | None], max_auc_loss: float, draws: int, seed: int) -> dict[str, Any]:
    """Every policy's numbers over the episodes every stage scored, and the cheapest band whose
    AUC is within `max_auc_loss` of the last stage alone (by estimated GPU-seconds per episode)."""
    stages, threshold = cascade["stages"], cascade["threshold"]
    successes = [bool(e["success"]) for e in episodes]
    costs = [[_stage_cost(s, model) for s in e["stages"]] for e in episodes]
    policies = []
    for index, stage in enumerate(stages):
        policies.append(_numbers(f"{stage['backend']} alone", "stage", [e["stages"][index]["score"] for e in episodes],
                                 successes, 0.0, [c[index] for c in costs], threshold, stage=stage["backend"]))
    configured = stages[0].get("band")
    configured = tuple(configured) if configured is not None else None
    rng = random.Random(seed)
    last = len(stages) - 1
    for band in bands:
        ran = replay(episodes, cascade, band)
        scores = [e["stages"][r[-1]]["score"] for e, r in zip(episodes, ran, strict=True)]
        spent = [_sum_costs([c[i] for i in r]) for c, r in zip(costs, ran, strict=True)]
        escalated = sum(len(r) > 1 for r in ran)
        name = f"cascade {_band_name(band)}" + (" (configured)" if band == configured else "")
        policies.append(_numbers(name, "cascade", scores, successes, escalated / len(episodes), spent, threshold,
                                 band=None if band is None else list(band), configured=band == configured,
                                 stages_run=[len(r) for r in ran]))
        policies.append(_random_policy(episodes, costs, successes, escalated, last, threshold, rng, draws, band))
    reasoning = policies[last]
    target = None if reasoning["auc"] is None else reasoning["auc"] - max_auc_loss
    within = [p for p in policies if p["kind"] == "cascade" and p["auc"] is not None and target is not None
              and p["auc"] >= target - 1e-12]
    cheapest = min(within, key=lambda p: (p["gpu_seconds_per_episode"], p["escalated_fraction"]), default=None)
    return {"episodes": len(episodes), "successes": sum(successes), "threshold": threshold,
            "stages": [s["backend"] for s in stages],
            "configured_band": None if configured is None else list(configured),
            "cost_model": {"prefill_tokens_per_s": model.prefill_tps, "decode_tokens_per_s": model.decode_tps,
                           "source": model.source,
                           "gpu_seconds": "prompt_tokens / prefill_tokens_per_s + completion_tokens / "
                                          "decode_tokens_per_s, summed over the calls an episode makes"},
            "max_auc_loss": max_auc_loss, "random_draws": draws, "seed": seed,
            "reference": reasoning["policy"], "reference_auc": reasoning["auc"],
            "cheapest_within_loss": None if cheapest is None else cheapest["policy"],
            "cheapest_band": None if cheapest is None else cheapest["band"],
            "policies": policies}


def _sum_costs(parts: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(p[key] for p in parts) for key in ("calls", "prompt_tokens", "completion_tokens", "seconds",
                                                        "gpu_seconds")}


def _random_policy(episodes: list[dict[str, Any]], costs: list[list[dict[str, float]]], successes: list[bool],
                   escalated: int, last: int, threshold: float, rng: random.Random, draws: int,
                   band: tuple[float, float] | None) -> dict[str, Any]:
    """`escalated` episodes chosen uniformly at random go to the last stage, the rest keep the first
    stage's score; every number is the mean over `draws` draws."""
    n = len(episodes)
    sums: dict[str, float] = {}
    aucs: list[float] = []
    for _ in range(draws):
        chosen = set(rng.sample(range(n), escalated))
        scores = [e["stages"][last if i in chosen else 0]["score"] for i, e in enumerate(episodes)]
        spent = [_sum_costs([c[0], c[last]] if i in chosen else [c[0]]) for i, c in enumerate(costs)]
        one = _numbers("", "random", scores, successes, escalated / n, spent, threshold)
        if one["auc"] is not None:
            aucs.append(one["auc"])
        for key in ("accuracy", "calls_per_episode", "prompt_tokens_per_episode", "completion_tokens_per_episode",
                    "gpu_seconds_per_episode", "measured_seconds_per_episode"):
            sums[key] = sums.get(key, 0.0) + one[key]
    return {"policy": f"random at {escalated}/{n} (as {_band_name(band)})", "kind": "random",
            "auc": sum(aucs) / len(aucs) if aucs else None, "escalated_fraction": escalated / n,
            **{key: value / draws for key, value in sums.items()}, "band": None if band is None else list(band),
            "draws": draws}


# -- the page ------------------------------------------------------------------------------------
KEYS = ("policy", "AUC", "accuracy", "escalated", "calls / ep", "prompt tokens / ep", "completion tokens / ep",
        "GPU-s / ep (est.)", "s / ep (measured)")
COLOURS = {"stage": "#1f77b4", "cascade": "#d62728", "random": "#7f7f7f"}


def _row(p: dict[str, Any], cheapest: str | None) -> dict[str, str]:
    mark = " ★" if p["policy"] == cheapest else ""
    return {"policy": p["policy"] + mark, "AUC": fmt(p["auc"], "3"), "accuracy": fmt(p["accuracy"], "3"),
            "escalated": fmt(p["escalated_fraction"], "%"), "calls / ep": fmt(round(p["calls_per_episode"], 3), "g"),
            "prompt tokens / ep": fmt(round(p["prompt_tokens_per_episode"], 1), "g"),
            "completion tokens / ep": fmt(round(p["completion_tokens_per_episode"], 1), "g"),
            "GPU-s / ep (est.)": f"{p['gpu_seconds_per_episode']:.4g}",
            "s / ep (measured)": f"{p['measured_seconds_per_episode']:.4g}"}


def _plot(result: dict[str, Any]) -> str:
    """AUC against estimated GPU-seconds per episode, as inline SVG (no plotting library needed)."""
    points = [p for p in result["policies"] if p["auc"] is not None]
    if not points:
        return "<p>No policy has an AUC (the episodes need both outcomes).</p>"
    width, height, pad = 720, 420, 60
    xs = [p["gpu_seconds_per_episode"] for p in points]
    ys = [p["auc"] for p in points]
    x_hi = max(xs) * 1.05 or 1.0
    y_lo, y_hi = min(min(ys), 0.5) - 0.02, 1.0

    def x(v: float) -> float:
        return pad + v / x_hi * (width - 2 * pad)

    def y(v: float) -> float:
        return height - pad - (v - y_lo) / (y_hi - y_lo) * (height - 2 * pad)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="AUC against GPU-seconds per episode" style="background:#fff;border:1px solid #ccc">',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#000"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#000"/>']
    for i in range(5):
        xv, yv = x_hi * i / 4, y_lo + (y_hi - y_lo) * i / 4
        parts.append(f'<text x="{x(xv):.1f}" y="{height - pad + 18}" font-size="11" text-anchor="middle">'
                     f"{xv:.3g}</text>")
        parts.append(f'<text x="{pad - 6}" y="{y(yv) + 4:.1f}" font-size="11" text-anchor="end">{yv:.2f}</text>')
    parts.append(f'<text x="{width / 2}" y="{height - 15}" font-size="12" text-anchor="middle">GPU-seconds per '
                 "episode (estimated)</text>")
    parts.append(f'<text x="15" y="{height / 2}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 15 {height / 2})">ROC-AUC vs success</text>')
    if result["reference_auc"] is not None:
        target = result["reference_auc"] - result["max_auc_loss"]
        if target >= y_lo:
            parts.append(f'<line x1="{pad}" y1="{y(target):.1f}" x2="{width - pad}" y2="{y(target):.1f}" '
                         'stroke="#2ca02c" stroke-dasharray="4 3"/>')
    for kind in ("cascade", "random"):
        line = sorted((p for p in points if p["kind"] == kind), key=lambda p: p["gpu_seconds_per_episode"])
        if len(line) > 1:
            path = " ".join(f"{x(p['gpu_seconds_per_episode']):.1f},{y(p['auc']):.1f}" for p in line)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{COLOURS[kind]}" stroke-width="1.5"/>')
    for p in points:
        cx, cy, colour = x(p["gpu_seconds_per_episode"]), y(p["auc"]), COLOURS[p["kind"]]
        radius = 7 if p["policy"] == result["cheapest_within_loss"] else 4
        parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{radius}" fill="{colour}"><title>'
                     f'{html.escape(p["policy"])}: AUC {p["auc"]:.3f}, {p["gpu_seconds_per_episode"]:.4g} GPU-s'
                     "</title></circle>")
        if p["kind"] == "stage":
            parts.append(f'<text x="{cx + 8:.1f}" y="{cy - 6:.1f}" font-size="11">{html.escape(p["stage"])}</text>')
    for i, (kind, label) in enumerate((("stage", "a stage alone"), ("cascade", "the cascade at a band"),
                                       ("random", "random escalation, same rate")), start=0):
        parts.append(f'<circle cx="{width - 220}" cy="{pad + 16 * i}" r="4" fill="{COLOURS[kind]}"/>'
                     f'<text x="{width - 210}" y="{pad + 16 * i + 4}" font-size="11">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def frontier_section(name: str, result: dict[str, Any]) -> str:
    model = result["cost_model"]
    cheapest = result["cheapest_within_loss"]
    verdict = (f"The cheapest band within {result['max_auc_loss']:g} AUC of <b>{html.escape(result['reference'])}"
               f"</b> (AUC {fmt(result['reference_auc'], '3')}): <b>{html.escape(cheapest)}</b>."
               if cheapest else f"No band comes within {result['max_auc_loss']:g} AUC of "
                                f"{html.escape(result['reference'])} on these episodes.")
    rows = [_row(p, cheapest) for p in result["policies"]]
    return (f'<h2 id="cascade-{html.escape(name)}">Cascade {html.escape(name)}: cost against quality</h2>'
            f"<p>{result['episodes']} episodes ({result['successes']} successes), stages "
            f"{html.escape(' → '.join(result['stages']))}, threshold {result['threshold']:g}; every stage scored "
            "every episode once and each policy is replayed from those scores (no further call).</p>"
            f'<p class="number">{verdict}</p>'
            f"<figure><figcaption>ROC-AUC against estimated GPU-seconds per episode (dashed: the reference's AUC "
            f"less {result['max_auc_loss']:g}; the big dot: the cheapest band within it)</figcaption>"
            f"{_plot(result)}</figure>"
            + table(KEYS, rows, caption=f"Policies of {name} (★: the cheapest band within the AUC loss)")
            + "<p class=\"note\">GPU-seconds are an <b>estimate</b>: prompt tokens at "
            f"{model['prefill_tokens_per_s']:,.0f} prefill tokens/s plus completion tokens at "
            f"{model['decode_tokens_per_s']:,.0f} decode tokens/s per GPU ({html.escape(model['source'])}). "
            "A one-token P(done) still pays its whole prefill. The measured seconds are the proxy's wall time per "
            "call on the server this eval used (queueing included), summed over the calls a policy makes. "
            f"Random escalation sends the same number of episodes to the last stage, chosen at random "
            f"({result['random_draws']} seeded draws, averaged): a band that does no better than it routes "
            "nothing.</p>")
