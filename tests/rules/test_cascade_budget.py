"""A cascade's single-call budget and what a run-limited key reads of the cascades: the rules alone."""

from __future__ import annotations

from proxy.config import CascadeConfig
from proxy.config.run_keys import RunScope
from proxy.http.run_access import visible_quality
from proxy.pipelines.cascade_state import CascadeState

STAGES = [{"backend": "cheap", "band": [0.2, 0.8]}, {"backend": "dear"}]


def test_calls_in_doubt_at_the_same_moment_cannot_all_pass_the_cap():
    """Each allowed call takes its place at once: with half the window allowed on, of ten calls in
    doubt asking before any has finished, exactly the share the cap allows go on."""
    state = CascadeState("c", CascadeConfig(stages=STAGES, max_escalated_fraction=0.5))
    for _ in range(10):
        state.note_single()  # ten sure calls: the window holds 10, none went on
    allowed = [state.allow_single() for _ in range(10)]
    went_on = sum(allowed)
    assert went_on == 10  # 0.5 of (10 + k): each allowed one counts at once, the cap rises with the window
    state = CascadeState("c", CascadeConfig(stages=STAGES, max_escalated_fraction=0.1))
    for _ in range(10):
        state.note_single()
    # a call goes on while the share before it is under the cap: 0 of 11, then 1 of 12 (< 1.2), then no
    # more; five concurrent calls in doubt could all have gone on when the window counted them at the end
    assert [state.allow_single() for _ in range(5)] == [True, True, False, False, False]


def test_a_limited_key_reads_only_its_runs_cascades_and_no_other_runs_counts():
    snapshot = {"keys": [], "alarms": [], "status": "ok",
                "cascades": [{"key": {"run": "runA-1", "backend": "c", "task_id": "t"}},
                             {"key": {"run": "runB-1", "backend": "c", "task_id": "t"}}],
                "restore": {"restored": True, "files": ["a"], "keys": 9, "alarms": 2}}
    cut = visible_quality(RunScope(run_prefixes=["runA-"]), snapshot)
    assert [c["key"]["run"] for c in cut["cascades"]] == ["runA-1"]
    assert cut["restore"] == {"restored": True, "files": ["a"]}
    assert visible_quality(None, snapshot) == snapshot
