"""Every error the proxy reports; codes, HTTP statuses and retryability come from one table
(vlm_protocol.errors.CODES), shared with the client.

    ProxyError                    500  internal_error       (a bug; logged with its traceback)
    ├── InvalidRequest            422  invalid_request      (bad field; `field` names it)
    │   ├── MediaNotFound         422  media_not_found
    │   ├── MediaForbidden        403  media_forbidden      (video_path outside allowed roots)
    │   ├── MediaDecodeError      422  media_decode_error   (corrupt video / image / npy)
    │   │   └── MediaFormatRefused 422 media_format_refused (not MP4/MOV, AVI, MKV/WebM, JPEG, PNG)
    │   ├── MediaDecoderFailed    422  media_decoder_failed (the video's worker process: a signal, memory or time)
    │   ├── MediaBudgetExceeded   413  media_budget_exceeded (decoded MiB, video frames or seconds over a cap)
    │   ├── TemplateVariableError 422  template_variable
    │   └── TokenBudgetExceeded   422  token_budget
    ├── PayloadTooLarge           413  payload_too_large
    ├── Unauthorized              401  unauthorized         (proxy.api_key_env set, token wrong)
    ├── AdminDisabled             403  admin_disabled       (admin routes on a proxy without proxy.admin_api_key_env)
    ├── AdminKeyRequired          403  admin_key_required   (an admin route called with the scoring key)
    ├── RunForbidden              403  run_forbidden        (a key limited to some runs named another; `field`)
    ├── EndpointHostForbidden     403  endpoint_host_forbidden (POST /admin/endpoints: host not in admin_endpoint_hosts)
    ├── UnknownBackend            404  unknown_backend
    ├── FrameRulesChanged         409  frame_rules_changed  (frames encoded for the backend's old frame rules)
    ├── RouteNotFound / MethodNotAllowed   404 not_found / 405 method_not_allowed
    ├── Overloaded                429  overloaded           (retryable)
    ├── ShuttingDown              503  shutting_down        (retryable)
    ├── ProgressGroupFailed       (the cause's) progress_group_failed (/progress: another episode of the task failed)
    ├── ReferenceMismatch         409  reference_mismatch   (/progress: stored vectors of another size)
    ├── ReferenceStoreFull        409  reference_store_full (/progress/references: too many demonstrations)
    ├── ReferenceKeysFull         409  reference_keys_full  (the store holds reference_store.max_keys tasks)
    ├── ConfigError               (start-up only, never an HTTP answer)
    ├── PromptTemplateError       500  prompt_template_invalid (a template file broke after an edit)
    └── UpstreamError             502  upstream_error       (base for failures of `vllm serve`)
        ├── UpstreamUnavailable   503  upstream_unavailable (connect errors, 429/5xx after retries)
        ├── UpstreamTimeout       504  upstream_timeout
        ├── UpstreamRejected      502  upstream_rejected    (a 4xx: our request was refused)
        │   └── MediaKwargsRefused 502 upstream_refuses_mm_kwargs
        ├── UpstreamProtocolError 502  upstream_bad_response (malformed JSON / shape)
        └── ScoreParseError       502  unparseable_score    (no declared answer in the reply)
            └── LabelParseError   502  unparseable_label    (/compare: no -1, 0 or 1 in the reply)

`proxy/http/error_answers.py` turns this tree into HTTP answers; nothing else builds error responses.
"""

from __future__ import annotations

from typing import Any

from vlm_protocol.errors import CODES

# The model's reply shown in an unparseable_score answer and in the audit log, at most.
MAX_REPLY_CHARS = 2000


class ProxyError(Exception):
    code: str = "internal_error"
    status_code: int = 500
    retryable: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        entry = CODES.get(cls.code)
        if entry is not None:  # ConfigError has no HTTP life
            cls.status_code, cls.retryable = entry.status, entry.retryable

    def __init__(self, message: str, *, attempts: int | None = None, retryable: bool | None = None,
                 **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.attempts = attempts
        if retryable is not None:
            self.retryable = retryable
        self.details = details

    def __str__(self) -> str:
        return self.message

    def within(self, where: str) -> ProxyError:
        """This error as one of part `where` of the request (`extra_view`, `items[3]`): its field
        becomes `where.<field>` (unless it is named there already) and its message names that field
        (a client may show only the message)."""
        field = self.details.get("field")
        if not (field and (field == where or field.startswith((f"{where}.", f"{where}[")))):
            field = f"{where}.{field}" if field else where
        self.details["field"] = field
        if isinstance(self, InvalidRequest):
            self.field = field
        if field not in self.message:
            self.message = f"{field}: {self.message}"
        return self

    def to_dict(self, request_id: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message, "retryable": self.retryable}
        if self.attempts is not None:
            body["attempts"] = self.attempts
        if request_id is not None:
            body["request_id"] = request_id
        body.update({k: v for k, v in self.details.items() if v is not None})
        return body

class InvalidRequest(ProxyError):
    code = "invalid_request"

    def __init__(self, message: str, *, field: str | None = None, **details: Any) -> None:
        super().__init__(message, field=field, **details)
        self.field = field


class MediaNotFound(InvalidRequest):
    code = "media_not_found"


class MediaForbidden(InvalidRequest):
    code = "media_forbidden"


class MediaDecodeError(InvalidRequest):
    code = "media_decode_error"


class MediaFormatRefused(MediaDecodeError):
    """A file whose first bytes are not a documented container or image (a playlist, a concat list,
    text...): never handed to a demuxer that might open another file. `detected` names what it is."""

    code = "media_format_refused"


class MediaDecoderFailed(InvalidRequest):
    """The worker decoding a video file died on it (a signal), hit its memory limit or its time limit."""

    code = "media_decoder_failed"


class MediaBudgetExceeded(InvalidRequest):
    """Decoding would pass a per-request cap; refused before any upstream call. `limit` names the
    setting, `needed` what the request would take (MiB, frames or seconds)."""

    code = "media_budget_exceeded"


class TemplateVariableError(InvalidRequest):
    code = "template_variable"


class TokenBudgetExceeded(InvalidRequest):
    code = "token_budget"


class Unauthorized(ProxyError):
    code = "unauthorized"


class AdminDisabled(ProxyError):
    """The admin routes change what the proxy trusts or pays: never without an admin key."""

    code = "admin_disabled"


class AdminKeyRequired(ProxyError):
    """The scoring key was sent to an admin route: a scorer is not an admin."""

    code = "admin_key_required"


class RunForbidden(ProxyError):
    """A key limited to some runs (proxy.run_keys) would write, or read, another run's episodes,
    ground truth or references."""

    code = "run_forbidden"


class EndpointHostForbidden(ProxyError):
    code = "endpoint_host_forbidden"


class RouteNotFound(ProxyError):
    code = "not_found"


class MethodNotAllowed(ProxyError):
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        self.allow = allow  # the Allow header's value


class PayloadTooLarge(ProxyError):
    code = "payload_too_large"


class UnknownBackend(ProxyError):
    code = "unknown_backend"


class FrameRulesChanged(ProxyError):
    """Frames encoded by the client for a backend's frame rules that are not its rules now."""

    code = "frame_rules_changed"


class Overloaded(ProxyError):
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class ShuttingDown(ProxyError):
    code = "shutting_down"
    retry_after_s = 1.0


class ReferenceMismatch(ProxyError):
    code = "reference_mismatch"


class ReferenceStoreFull(ProxyError):
    code = "reference_store_full"


class ReferenceKeysFull(ProxyError):
    """No new (namespace, task) key: the store holds reference_store.max_keys; existing keys still work."""

    code = "reference_keys_full"


class ProgressGroupFailed(ProxyError):
    """Another episode of the task failed: this one's progress cannot be computed. Its status and
    retryability are the cause's (a bad frame is a 422, a vLLM outage a retryable 503)."""

    code = "progress_group_failed"

    @classmethod
    def of(cls, cause: ProxyError, task: str, index: int) -> ProgressGroupFailed:
        err = cls(f"episode {index} of task {task!r} failed ({cause.code}: {cause.message[:200]}); a task's "
                  "progress needs every one of its episodes", retryable=cause.retryable, task_id=task,
                  failed_index=index, cause=cause.code)
        err.status_code = cause.status_code
        return err


class ConfigError(ProxyError):
    code = "config_error"


class PromptTemplateError(ProxyError):
    """A template file that cannot be loaded (bad YAML, undeclared variable): an operator error."""

    code = "prompt_template_invalid"


class UpstreamError(ProxyError):
    code = "upstream_error"

    def __init__(
        self,
        message: str,
        *,
        endpoint: str | None = None,
        upstream_status: int | None = None,
        retry_after_s: float | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message, endpoint=endpoint, upstream_status=upstream_status, **details)
        self.endpoint = endpoint
        self.upstream_status = upstream_status
        # A server's Retry-After, honoured by the retry policy; not part of the reply body.
        self.retry_after_s = retry_after_s


class UpstreamUnavailable(UpstreamError):
    code = "upstream_unavailable"


class UpstreamTimeout(UpstreamError):
    code = "upstream_timeout"
    # False when the wait ended before the call's own limit for the replica's sake (no connection
    # within the connect timeout): then it is the replica's failure whoever set the limit.
    at_limit = True


class UpstreamRejected(UpstreamError):
    code = "upstream_rejected"


class MediaKwargsRefused(UpstreamRejected):
    code = "upstream_refuses_mm_kwargs"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_bad_response"



class ScoreParseError(UpstreamError):
    """No declared answer in the model's reply. `output_text` (bounded) and `finish_reason` go
    into the answer and the audit log, so users see what the model said."""

    code = "unparseable_score"

    def __init__(self, message: str, *, output_text: str | None = None,
                 finish_reason: str | None = None, **details: Any) -> None:
        shown = None if output_text is None else output_text[:MAX_REPLY_CHARS]
        super().__init__(message, output_text=shown, finish_reason=finish_reason, **details)
        self.output_text = output_text
        self.finish_reason = finish_reason


class LabelParseError(ScoreParseError):
    """/compare: the reply holds no preference label (-1, 0 or 1); re-asked like an unparseable score."""

    code = "unparseable_label"


# Transport-level failures worth another try (proxy/upstream/retry.py's policy).
RETRYABLE_UPSTREAM = (UpstreamUnavailable, UpstreamTimeout, UpstreamProtocolError)
