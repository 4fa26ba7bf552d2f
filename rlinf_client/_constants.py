"""Every default of the client in one place (timeouts, retries, backoff, buffering)."""

from __future__ import annotations

DEFAULT_ENDPOINT = "http://127.0.0.1:18080/score"
SCORE_PATH = "/score"
BATCH_PATH = "/score/batch"
HEALTH_PATH = "/health"

# Seconds for one episode, retries and backoff included (the seed's per-request timeout).
DEFAULT_TIMEOUT = 120.0
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_MAX_RETRIES = 4
INITIAL_RETRY_DELAY = 0.5
MAX_RETRY_DELAY = 8.0
MAX_RETRY_AFTER = 60.0  # a Retry-After above this is treated as "do not wait"
RETRY_STATUS_CODES = frozenset({429, 503})

DEFAULT_MAX_CONCURRENCY = 64  # requests in flight per client (= connection pool size)
DEFAULT_MAX_BATCH_EPISODES = 64
DEFAULT_MAX_BATCH_BYTES = 48 * 2**20  # stay under the proxy's 64 MiB body cap

# What the seed's reward_model block defaults to.
DEFAULT_NFRAMES = 16
DEFAULT_MAX_PIXELS = 200_704  # 256 * 28 * 28
DEFAULT_VIDEO_FPS = 4.0  # the rate the sampled clip is presented at (the seed's MP4 fps)
DEFAULT_SUCCESS_THRESHOLD = 0.5

# Frames kept per env per episode; 0 keeps every frame (exact sampling, ~100 MB per 512-step
# episode at 256x256). 64 frames at 256x256 are 12.6 MB per env.
DEFAULT_BUFFER_FRAMES = 64

# RLinf observation keys holding the agent-view camera, newest first.
OBS_IMAGE_KEYS = ("main_images", "full_images", "images")

USER_AGENT = "vlm-reward-proxy-rlinf-client"
