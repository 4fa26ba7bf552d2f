"""Every error code the proxy answers with: its HTTP status and whether a client may retry it.

The proxy's exception classes (proxy/errors.py) take their status from this table, and the
client (rlinf_client) decides what to retry from it, so the two never disagree. An answer's
body can override `retryable` for one instance (e.g. `upstream_unavailable` is retryable only
when the proxy made no upstream call: every replica was out of rotation).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CODES", "ErrorCode", "is_retryable", "status_of"]


@dataclass(frozen=True)
class ErrorCode:
    code: str
    status: int
    retryable: bool  # may a client send the same request again (within its own deadline)?
    meaning: str


CODES: dict[str, ErrorCode] = {c.code: c for c in (
    ErrorCode("invalid_request", 422, False, "a field is wrong; `field` names it"),
    ErrorCode("media_not_found", 422, False, "video_path does not exist"),
    ErrorCode("media_forbidden", 403, False, "video_path is outside proxy.allowed_media_roots"),
    ErrorCode("media_decode_error", 422, False, "a video, image or npy that cannot be decoded"),
    ErrorCode("media_format_refused", 422, False,
              "a file whose content is not a documented format (MP4/MOV, AVI, MKV/WebM; JPEG, PNG); "
              "`detected` names what it is"),
    ErrorCode("media_budget_exceeded", 413, False,
              "decoding the media would pass a per-request cap (proxy.max_decoded_mb, max_video_frames, "
              "max_video_seconds); `limit` names it"),
    ErrorCode("media_decoder_failed", 422, False,
              "the worker process decoding a video file was killed by a signal, ran out of its memory limit or "
              "its time limit on that file (`cause`: signal, memory or timeout); not retried: the file did it"),
    ErrorCode("template_variable", 422, False, "a variable the prompt template needs is missing"),
    ErrorCode("token_budget", 422, False, "prompt + max_tokens would exceed the model's context"),
    ErrorCode("unauthorized", 401, False, "missing or wrong bearer token"),
    ErrorCode("admin_disabled", 403, False,
              "the admin routes (what the proxy trusts or pays) need proxy.admin_api_key_env (an admin key)"),
    ErrorCode("admin_key_required", 403, False, "the scoring key sent to an admin route (it takes only the admin key)"),
    ErrorCode("run_forbidden", 403, False,
              "a key limited to some runs (proxy.run_keys) named another run, or none; `field` names where"),
    ErrorCode("endpoint_host_forbidden", 403, False, "an endpoint whose host is not in proxy.admin_endpoint_hosts"),
    ErrorCode("frame_rules_changed", 409, False,
              "the frames were encoded for frame rules the backend no longer has (`current` names its rules "
              "id): send the episode's raw frames, and fetch GET /frame-rules again"),
    ErrorCode("unknown_backend", 404, False, "no backend of that name; the message lists them"),
    ErrorCode("not_found", 404, False, "no such route"),
    ErrorCode("method_not_allowed", 405, False, "the route exists, the method does not"),
    ErrorCode("payload_too_large", 413, False, "body over proxy.max_body_mb"),
    ErrorCode("overloaded", 429, True, "the backend's admission queue is full (Retry-After)"),
    ErrorCode("shutting_down", 503, True, "the proxy is stopping; nothing was scored"),
    ErrorCode("internal_error", 500, False, "a bug: logged with its traceback"),
    ErrorCode("prompt_template_invalid", 500, False, "a template file broke after an edit"),
    ErrorCode("upstream_error", 502, False, "vLLM failed"),
    ErrorCode("upstream_unavailable", 503, False,
              "vLLM unreachable or 429/5xx after the retry budget (retryable when no call was made)"),
    ErrorCode("upstream_timeout", 504, False, "vLLM did not answer within the deadline"),
    ErrorCode("upstream_rejected", 502, False, "vLLM refused the request (4xx)"),
    ErrorCode("upstream_refuses_mm_kwargs", 502, False, "vLLM lacks --trust-request-mm-kwargs"),
    ErrorCode("upstream_bad_response", 502, False, "vLLM answered something that is not a completion"),
    ErrorCode("unparseable_score", 502, False, "the model's replies held no declared answer"),
    ErrorCode("unparseable_label", 502, False, "the model's replies held no preference label (-1, 0 or 1)"),
    ErrorCode("progress_group_failed", 502, False,
              "another episode of the same task failed (`cause` its code; the status and retryability are the "
              "cause's): that task's progress cannot be computed"),
    ErrorCode("reference_mismatch", 409, False,
              "stored references of the task have another dimension than the model's embeddings"),
    ErrorCode("reference_store_full", 409, False, "the task already holds reference_store.max_demonstrations"),
    ErrorCode("reference_keys_full", 409, False,
              "the reference store holds reference_store.max_keys (namespace, task) keys: no new one is added"),
)}


def status_of(code: str) -> int:
    return CODES[code].status


def is_retryable(code: str | None, status: int, explicit: bool | None = None) -> bool:
    """Whether a client may retry an error answer: the answer's own word first, then the table;
    an unknown code (another server in the way) is retried only for 429."""
    if explicit is not None:
        return explicit
    known = CODES.get(code or "")
    return known.retryable if known is not None else status == 429
