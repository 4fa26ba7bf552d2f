"""The monitor's cascade window keeps running sums (an episode costs its own stages, not the
window's): over a random stream of episodes they equal the obvious recount of the window's
entries after every episode, and a forgotten key takes its gauges with it."""

from __future__ import annotations

import random

from proxy.metrics import Metrics
from proxy.quality.cascade_window import WHYS, CascadeWatch, window_numbers


def test_the_running_sums_equal_a_recount_of_the_window_after_every_episode():
    rng = random.Random(5)
    watch = CascadeWatch(window=16, max_keys=2, metrics=Metrics())
    kept: list = []
    for _ in range(300):
        outcomes = []
        for stage in ("cheap", "middle")[: rng.randint(1, 2)]:
            why = rng.choice([None, *WHYS])
            outcomes.append((stage, why, rng.choice([True, False]) if why == "audit" else None))
        kept = [*kept, outcomes][-16:]
        assert watch.observe(("run", "cascade", "t"), outcomes) == window_numbers(kept)


def test_a_forgotten_key_takes_its_gauges_with_it():
    metrics = Metrics()
    watch = CascadeWatch(window=4, max_keys=1, metrics=metrics)
    watch.observe(("a", "c", "t"), [("cheap", "band", None)])
    watch.observe(("b", "c", "t"), [("cheap", None, None)])
    runs = {s.labels["run"] for family in metrics.registry.collect() for s in family.samples
            if s.name == "vlm_proxy_cascade_escalation_rate"}
    assert runs == {"b"} and [e["key"]["run"] for e in watch.snapshot()] == ["b"]
