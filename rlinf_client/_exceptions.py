"""The client's one exception tree.

    RewardClientError
    ├── RewardConfigError (ValueError)          a bad `reward_model` block
    ├── FramesError (ValueError)                frames that cannot be sent (empty, wrong shape)
    ├── EpisodeMetadataError (ValueError)       reward_source: progress, an episode without
    │                                           metadata.task_id or metadata.env_success
    ├── MissingDependencyError (ImportError)    OpenCV missing for `transport: path`
    ├── NoReferenceError                        reward_source: progress, on_no_reference: raise, and a
    │                                           failure had no success of its task to compare with
    ├── QualityAlarmError                       on_quality_alarm: raise, and the proxy's reward-quality
    │                                           monitor said alarm for an episode's (run, backend, task)
    └── RewardAPIError                          talking to the proxy failed; `.code`, `.attempts`
        ├── APIConnectionError                  no HTTP answer (refused, reset, closed)
        │   └── APITimeoutError                 the episode's `timeout` ran out
        ├── APIResponseValidationError          a 200 whose body is not a score
        └── APIStatusError                      an error answer: `.status_code`, the proxy's `.code`,
            │                                   `.retryable` (the proxy's word, else vlm_protocol's table)
            ├── BadRequestError           400
            ├── AuthenticationError       401   (unauthorized: set api_key / VLM_REWARD_PROXY_API_KEY)
            ├── ForbiddenError            403   (e.g. media_forbidden)
            ├── NotFoundError             404   (e.g. unknown_backend)
            ├── PayloadTooLargeError      413
            ├── UnprocessableEntityError  422   (invalid_request, media_decode_error, ...)
            ├── RateLimitError            429   (overloaded; retried, honouring Retry-After)
            ├── InternalServerError       500 and any other 5xx not below
            ├── BadGatewayError           502   (upstream_error, unparseable_score, ...)
            ├── ServiceUnavailableError   503   (upstream_unavailable; retried)
            └── GatewayTimeoutError       504   (upstream_timeout)

`make_status_error` is the only place an HTTP status becomes a class.
"""

from __future__ import annotations

from typing import Any

from vlm_protocol.errors import is_retryable

__all__ = [
    "APIConnectionError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadGatewayError",
    "BadRequestError",
    "EpisodeMetadataError",
    "ForbiddenError",
    "FramesError",
    "GatewayTimeoutError",
    "InternalServerError",
    "MissingDependencyError",
    "NoReferenceError",
    "NotFoundError",
    "PayloadTooLargeError",
    "QualityAlarmError",
    "RateLimitError",
    "RewardAPIError",
    "RewardClientError",
    "RewardConfigError",
    "ServiceUnavailableError",
    "UnprocessableEntityError",
    "make_status_error",
]


class RewardClientError(Exception):
    """Base of everything this package raises."""


class RewardConfigError(RewardClientError, ValueError):
    pass


class FramesError(RewardClientError, ValueError):
    code = "invalid_frames"


class EpisodeMetadataError(RewardClientError, ValueError):
    code = "invalid_metadata"


class MissingDependencyError(RewardClientError, ImportError):
    pass


class NoReferenceError(RewardClientError):
    """A failed episode the proxy could not rate (outcome no_reference), under on_no_reference: raise."""

    code = "no_reference"


class QualityAlarmError(RewardClientError):
    """The proxy's reward-quality monitor said `alarm` for an episode (its reward disagrees with the
    simulator's success beyond a bound for that run, backend and task), under on_quality_alarm: raise.
    `alarms`: the alarmed answers' `quality` objects, one per episode."""

    code = "quality_alarm"

    def __init__(self, message: str, alarms: tuple[dict[str, Any], ...] = ()) -> None:
        super().__init__(message)
        self.alarms = alarms


class RewardAPIError(RewardClientError):
    """A failed request to the proxy. `code` is machine-readable; `attempts` counts HTTP tries."""

    code: str = "api_error"

    def __init__(self, message: str, *, attempts: int = 1, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.attempts = attempts
        if code is not None:
            self.code = code


class APIConnectionError(RewardAPIError):
    code = "connection_error"


class APITimeoutError(APIConnectionError):
    code = "timeout"


class APIResponseValidationError(RewardAPIError):
    code = "bad_response"


class APIStatusError(RewardAPIError):
    """The proxy answered with an error. `code` is the proxy's `error.code` when it sent one."""

    status_code: int = 0

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        code: str | None = None,
        attempts: int = 1,
        body: Any = None,
        field: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message, attempts=attempts, code=code or f"http_{status_code}")
        self.status_code = status_code
        self.body = body
        self.field = field
        self.request_id = request_id
        self.retry_after = retry_after
        self.retryable = retryable

    def __str__(self) -> str:
        return f"{self.status_code} {self.code}: {self.message}"


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class ForbiddenError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class PayloadTooLargeError(APIStatusError):
    pass


class UnprocessableEntityError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


class BadGatewayError(InternalServerError):
    pass


class ServiceUnavailableError(InternalServerError):
    pass


class GatewayTimeoutError(InternalServerError):
    pass


_STATUS_CLASSES: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: ForbiddenError,
    404: NotFoundError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    500: InternalServerError,
    502: BadGatewayError,
    503: ServiceUnavailableError,
    504: GatewayTimeoutError,
}


def make_status_error(
    status_code: int,
    body: Any,
    *,
    attempts: int = 1,
    request_id: str | None = None,
    retry_after: float | None = None,
) -> APIStatusError:
    """The typed error for an error answer; reads the proxy's `{"error": {...}}` shape if present.
    Whether it may be retried is the answer's own `retryable`, else the shared code table's."""
    error = body.get("error") if isinstance(body, dict) else None
    code = message = field = explicit = None
    if isinstance(error, dict):
        code = error.get("code") if isinstance(error.get("code"), str) else None
        message = error.get("message")
        field = error.get("field")
        request_id = request_id or error.get("request_id")
        explicit = error.get("retryable") if isinstance(error.get("retryable"), bool) else None
    elif isinstance(body, dict) and "detail" in body:  # a framework's own answer (e.g. 404 route)
        message = str(body["detail"])
    if not message:
        message = body if isinstance(body, str) and body else f"HTTP {status_code}"
    cls = _STATUS_CLASSES.get(status_code)
    if cls is None:
        cls = InternalServerError if status_code >= 500 else APIStatusError
    return cls(str(message)[:2000], status_code=status_code, code=code, attempts=attempts, body=body,
               field=field, request_id=request_id, retry_after=retry_after,
               retryable=is_retryable(code, status_code, explicit))
