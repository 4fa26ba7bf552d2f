"""The /progress surface: POST /progress/batch (SRPO progress of a step's failures against its
successes) and POST /progress/references (demonstrations kept per task); docs/progress.md."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from proxy.protocol.common import ErrorDetail, FramesInfo, ShortString
from proxy.protocol.score import ScoreRequest
from vlm_protocol.progress import OUTCOMES

Outcome = Literal[OUTCOMES]


class ProgressBatchRequest(BaseModel):
    """Episodes of one step (any tasks): metadata.task_id and metadata.env_success are required.
    Every item is checked before any is embedded: a task's progress depends on all of its episodes."""

    model_config = ConfigDict(extra="forbid")

    backend: str | None = None  # an embedding backend; None = the first one
    items: list[ScoreRequest] = Field(min_length=1)
    include_embeddings: StrictBool = False  # the vectors in the answer (large: for research, not training)
    use_reference_store: StrictBool = True  # join the task's stored references, when a store is configured
    remember_successes: StrictBool = True  # add this batch's successes to the store after answering
    # The store keeps references per namespace: one training run's successes are not another's.
    reference_namespace: ShortString | None = None


class ReferencesRequest(BaseModel):
    """Demonstrations of one task, embedded and kept as references (never evicted)."""

    model_config = ConfigDict(extra="forbid")

    backend: str | None = None
    task_id: int | ShortString
    items: list[ScoreRequest] = Field(min_length=1)
    reference_namespace: ShortString | None = None  # as in ProgressBatchRequest


class ProgressReference(BaseModel):
    """What a failure was measured against."""

    batch_successes: int  # successes of the task in this batch
    stored: int  # references of the task from the store
    centres: int  # DBSCAN cluster centres (1: the references' mean)
    clustered: bool
    failures: int  # failures the distances were normalised over


class EmbeddingInfo(BaseModel):
    model: str
    endpoint: str
    dim: int
    attempts: int
    usage: dict[str, Any] | None = None
    frames: FramesInfo
    timings_ms: dict[str, float]
    vector: list[float] | None = None  # include_embeddings


class ProgressResult(BaseModel):
    task_id: int | str
    env_success: bool
    outcome: Outcome
    progress: float | None  # 1.0 for a success; null when the task has no reference
    distance: float | None = None
    normalised_distance: float | None = None
    reference: ProgressReference | None = None
    embedding: EmbeddingInfo


class ProgressItem(BaseModel):
    index: int
    ok: bool
    status: int
    result: ProgressResult | None = None
    error: ErrorDetail | None = None


class NotRemembered(BaseModel):
    """A task whose successes the reference store did not keep (its progress answers stand)."""

    task_id: int | str
    successes: int  # the successes of this batch not kept
    code: str  # reference_keys_full (a new namespace/task beyond max_keys), reference_mismatch, os_error
    message: str


class ReferencesUsed(BaseModel):
    """The reference store as this request met it: which namespace (the run's identity, the RLinf
    client's `reward_model` run/job/resume) and how many references each task held before it."""

    namespace: str  # "" when the request named none (shared by every caller that names none)
    store: bool  # a store is configured and the request used it (use_reference_store)
    at_start: dict[str, int]  # task id (as text) -> references held before this request
    total_at_start: int


class ProgressBatchResponse(BaseModel):
    results: list[ProgressItem]
    references: ReferencesUsed
    summary: dict[str, int]  # ok, failed, success, progress, no_reference, tasks
    method: dict[str, Any]  # the formula's constants and source (proxy/progress/math.py)
    # Empty when every success asked to be remembered was kept (remember_successes, a store configured).
    not_remembered: list[NotRemembered] = Field(default_factory=list)


class ReferencesResponse(BaseModel):
    backend: str
    model: str
    task_id: int | str
    added: int
    demonstrations: int  # the task now holds
