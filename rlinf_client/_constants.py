"""Every default of the client in one place (timeouts, retries, backoff, buffering)."""

from __future__ import annotations

from vlm_protocol.progress import PROGRESS_PATH
from vlm_protocol.wire import BATCH_PATH, DENSE_PATH, FRAME_RULES_PATH, HEALTH_PATH, SCORE_PATH

__all__ = ["BATCH_PATH", "DENSE_PATH", "FRAME_RULES_PATH", "HEALTH_PATH", "PROGRESS_BATCH_PATH", "SCORE_PATH"]

PROGRESS_BATCH_PATH = PROGRESS_PATH  # reward_source: progress (docs/progress.md)

DEFAULT_ENDPOINT = "http://127.0.0.1:18080/score"

# Seconds for one score_episode / score_episodes call, retries and backoff included (the
# seed's per-request timeout). Every call returns within it, with each episode scored or failed.
DEFAULT_TIMEOUT = 120.0
DEFAULT_CONNECT_TIMEOUT = 5.0
# Re-sends of a request the proxy refused before any upstream call (429 overloaded, or an answer
# marked retryable) or that never reached it (connection refused).
DEFAULT_MAX_RETRIES = 4
INITIAL_RETRY_DELAY = 0.5
MAX_RETRY_DELAY = 8.0
# A call that has not returned this long after its timeout is abandoned (a backstop: the
# schedule itself already ends at the timeout).
RETURN_MARGIN_S = 2.0
# The proxy's bearer token, when `api_key` is not set in the config.
API_KEY_ENV = "VLM_REWARD_PROXY_API_KEY"

DEFAULT_MAX_CONCURRENCY = 64  # requests in flight per client (= connection pool size)
DEFAULT_MAX_BATCH_EPISODES = 16  # episodes per POST /score/batch
DEFAULT_MAX_BATCH_BYTES = 48 * 2**20  # stay under the proxy's 64 MiB body cap
DEFAULT_MAX_PROGRESS_ITEMS = 256  # episodes per POST /progress/batch (whole tasks; the proxy's cap is 512)
# Encoded request bodies held at once (built, in flight or waiting): bounds the client's memory
# (16 frames of 256x256 inline are ~4 MiB each).
MAX_BODIES_IN_MEMORY = 64

# What the seed's reward_model block defaults to.
DEFAULT_NFRAMES = 16
DEFAULT_MAX_PIXELS = 200_704  # 256 * 28 * 28
DEFAULT_VIDEO_FPS = 4.0  # the rate the sampled clip is presented at (the seed's MP4 fps)
DEFAULT_EPISODE_FPS = 20.0  # LIBERO's control rate: one frame per env step
DEFAULT_SUCCESS_THRESHOLD = 0.5

# Frames kept per env per episode; 0 keeps every frame (exact sampling, ~100 MB per 512-step
# episode at 256x256). 64 frames at 256x256 are 12.6 MB per env.
DEFAULT_BUFFER_FRAMES = 64

# RLinf observation keys holding the agent-view camera, newest first.
OBS_IMAGE_KEYS = ("main_images", "full_images", "images")

USER_AGENT = "vlm-reward-proxy-rlinf-client"

# After a failed GET /frame-rules (not a 404: the proxy has the route), raw frames are sent for
# this long before it is asked again.
FRAME_RULES_RETRY_S = 30.0

# The run identity (RewardModelConfig.identity): `run` then "-" and this many hex digits of the
# job's digest; 240 + 11 stays within the proxy's 256 characters for a metadata string.
MAX_RUN_LABEL = 240
RUN_DIGEST_CHARS = 10
