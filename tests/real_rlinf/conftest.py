"""The real-RLinf tier prints what it measured (times, versions, the reward table) at the end."""

from __future__ import annotations

import json

from tests.helpers import SUMMARIES
from tests.real_rlinf._support import SUMMARY


def _summary() -> list[str]:
    if not SUMMARY:
        return []
    lines = []
    timings = SUMMARY.get("timings", {})
    lines.append("real_rlinf: " + json.dumps({k: (round(v, 1) if isinstance(v, float) else v)
                                              for k, v in timings.items() if not isinstance(v, dict)}))
    for key in ("resets_s", "step_mean_s", "scenario_s", "real_vllm"):
        if timings.get(key):
            lines.append(f"real_rlinf {key}: " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                                             for k, v in timings[key].items()}))
    if timings.get("runner"):
        lines.append("real_rlinf runner process: " + json.dumps({k: round(v, 1) for k, v in timings["runner"].items()
                                                                if isinstance(v, float)}))
    if SUMMARY.get("versions"):
        lines.append("real_rlinf versions: " + json.dumps(SUMMARY["versions"]))
    if SUMMARY.get("real_vllm_outcome"):
        lines.append(f"real_rlinf real vLLM per env: {SUMMARY['real_vllm_outcome']}")
    lines.extend("real_rlinf reward: " + json.dumps(row) for row in SUMMARY.get("reward_table", []))
    return lines


SUMMARIES.append(_summary)
