"""Every error the proxy reports, each with its HTTP status and a machine-readable code.

    ProxyError
    ├── InvalidRequest            422  invalid_request      (bad field; `field` names it)
    │   ├── MediaNotFound         422  media_not_found
    │   ├── MediaForbidden        403  media_forbidden      (video_path outside allowed roots)
    │   ├── MediaDecodeError      422  media_decode_error   (corrupt video / image / npy)
    │   ├── TemplateVariableError 422  template_variable
    │   └── TokenBudgetExceeded   422  token_budget
    ├── PayloadTooLarge           413  payload_too_large
    ├── Unauthorized              401  unauthorized         (proxy.api_key_env set, token wrong)
    ├── UnknownBackend            404  unknown_backend
    ├── RouteNotFound / MethodNotAllowed   404 not_found / 405 method_not_allowed
    ├── Overloaded                429  overloaded
    ├── ConfigError               (start-up only, never an HTTP answer)
    ├── PromptTemplateError       500  prompt_template_invalid (a template file broke after an edit)
    └── UpstreamError             502  upstream_error       (base for failures of `vllm serve`)
        ├── UpstreamUnavailable   503  upstream_unavailable (connect errors, 429/5xx after retries)
        ├── UpstreamTimeout       504  upstream_timeout
        ├── UpstreamRejected      502  upstream_rejected    (a 4xx: our request was refused)
        │   └── MediaKwargsRefused 502 upstream_refuses_mm_kwargs
        ├── UpstreamProtocolError 502  upstream_bad_response (malformed JSON / shape)
        └── ScoreParseError       502  unparseable_score    (no score in the model's reply)

`api.py` maps this tree to HTTP in one handler; nothing else builds error responses.
"""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    status_code: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, attempts: int | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.attempts = attempts
        self.details = details

    def to_dict(self, request_id: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.attempts is not None:
            body["attempts"] = self.attempts
        if request_id is not None:
            body["request_id"] = request_id
        body.update({k: v for k, v in self.details.items() if v is not None})
        return body


class InvalidRequest(ProxyError):
    status_code = 422
    code = "invalid_request"

    def __init__(self, message: str, *, field: str | None = None, **details: Any) -> None:
        super().__init__(message, field=field, **details)
        self.field = field


class MediaNotFound(InvalidRequest):
    code = "media_not_found"


class MediaForbidden(InvalidRequest):
    status_code = 403
    code = "media_forbidden"


class MediaDecodeError(InvalidRequest):
    code = "media_decode_error"


class TemplateVariableError(InvalidRequest):
    code = "template_variable"


class TokenBudgetExceeded(InvalidRequest):
    code = "token_budget"


class Unauthorized(ProxyError):
    status_code = 401
    code = "unauthorized"


class RouteNotFound(ProxyError):
    status_code = 404
    code = "not_found"


class MethodNotAllowed(ProxyError):
    status_code = 405
    code = "method_not_allowed"


class PayloadTooLarge(ProxyError):
    status_code = 413
    code = "payload_too_large"


class UnknownBackend(ProxyError):
    status_code = 404
    code = "unknown_backend"


class Overloaded(ProxyError):
    status_code = 429
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class ConfigError(ProxyError):
    code = "config_error"


class UpstreamError(ProxyError):
    status_code = 502
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
    status_code = 503
    code = "upstream_unavailable"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    code = "upstream_timeout"


class UpstreamRejected(UpstreamError):
    code = "upstream_rejected"


class MediaKwargsRefused(UpstreamRejected):
    code = "upstream_refuses_mm_kwargs"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_bad_response"


class ScoreParseError(UpstreamError):
    code = "unparseable_score"

    def __init__(self, message: str, *, output_text: str | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        self.output_text = output_text


# Retry classification lives in retry.py; these are the transport-level failures worth a retry.
RETRYABLE_UPSTREAM = (UpstreamUnavailable, UpstreamTimeout, UpstreamProtocolError)


class PromptTemplateError(ProxyError):
    """A template file that cannot be loaded (bad YAML, undeclared variable): an operator error."""

    status_code = 500
    code = "prompt_template_invalid"
