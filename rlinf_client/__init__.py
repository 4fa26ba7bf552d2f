"""Client for the VLM Reward Proxy, for RLinf's env workers (needs only httpx and numpy).

    from rlinf_client import RewardClient
    with RewardClient(endpoint="http://127.0.0.1:18080/score", backend="qwen2_5_vl_vllm") as client:
        result = client.score_episode(frames, "put the bowl on the plate", fallback=0.0)
        result.ok, result.value, result.reason

`rlinf_client.hook.LiberoVLMReward` wires it into RLinf's LiberoEnv; `rlinf_client.mapping`
holds the score → reward rules (training curves: `reports`, outside the client).
"""

from rlinf_client._client import AsyncRewardClient, RewardClient
from rlinf_client._config import RewardModelConfig, RewardModelOptions
from rlinf_client._exceptions import (
    APIConnectionError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadGatewayError,
    BadRequestError,
    EpisodeMetadataError,
    ForbiddenError,
    FramesError,
    GatewayTimeoutError,
    InternalServerError,
    MissingDependencyError,
    NoReferenceError,
    NotFoundError,
    PayloadTooLargeError,
    QualityAlarmError,
    RateLimitError,
    RewardAPIError,
    RewardClientError,
    RewardConfigError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from rlinf_client._frames import EpisodeFrameBuffer, env_frames_from_obs, sample_indices, to_uint8_frames
from rlinf_client._types import ClientStats, Episode, EpisodeProgress, EpisodeScore

__version__ = "0.1.0"

__all__ = [
    "APIConnectionError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncRewardClient",
    "AuthenticationError",
    "BadGatewayError",
    "BadRequestError",
    "ClientStats",
    "Episode",
    "EpisodeFrameBuffer",
    "EpisodeMetadataError",
    "EpisodeProgress",
    "EpisodeScore",
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
    "RewardClient",
    "RewardClientError",
    "RewardConfigError",
    "RewardModelConfig",
    "RewardModelOptions",
    "ServiceUnavailableError",
    "UnprocessableEntityError",
    "env_frames_from_obs",
    "sample_indices",
    "to_uint8_frames",
]
