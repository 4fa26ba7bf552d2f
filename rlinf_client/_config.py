"""`RewardModelConfig`: the seed's `reward_model` block, plus a few additions with safe defaults.

Read it from RLinf's config with `RewardModelConfig.from_mapping(cfg.reward_model)` (a plain dict
or an OmegaConf node); unknown keys are refused so a typo cannot silently fall back to a default.
`RewardModelOptions` names the same keys with their types, for the clients' keyword arguments.

The seed's `fail_on_request_error` and `fallback: raise` are one switch: `fallback` holds it, and
the seed's key is still read (true: `fallback: raise`), with one log line naming `fallback`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypedDict

from rlinf_client import _constants as C
from rlinf_client._exceptions import RewardConfigError
from vlm_protocol import strict_yaml

__all__ = ["RewardModelConfig", "RewardModelOptions"]

log = logging.getLogger("rlinf_client")

Transport = Literal["inline", "path", "binary"]
FrameEncoding = Literal["auto", "raw"]
BatchMode = Literal["auto", "never"]
Fallback = Literal["raise", "zero", "env_success"]
FALLBACKS = ("raise", "zero", "env_success")
RewardSource = Literal["score", "progress"]
OnNoReference = Literal["native", "raise"]
OnQualityAlarm = Literal["keep", "native", "raise"]
QUALITY_ALARM_POLICIES = ("keep", "native", "raise")


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    # -- the seed's keys (same names, same meaning) --------------------------------------------
    enable: bool = False
    endpoint: str = C.DEFAULT_ENDPOINT  # the proxy's /score URL (a bare base URL works too)
    # Seconds for one call (score_episodes: every env that ended at this step, all its requests and
    # retries), not per episode: at a step where 64 envs end, all 64 share it (the fork's client gave
    # each request its own timeout). Size it for the burst the proxy will see.
    timeout: float = C.DEFAULT_TIMEOUT
    nframes: int = C.DEFAULT_NFRAMES
    max_pixels: int = C.DEFAULT_MAX_PIXELS
    backend: str | None = None  # None = the proxy's default backend
    backend_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    video_fps: float = C.DEFAULT_VIDEO_FPS  # rate the sampled clip is presented at
    # The seed's spelling of `fallback: raise` (true) or of leaving `fallback` unset (false): read
    # into `fallback` at load, not kept. Reading it back gives `fallback == "raise"`.
    fail_on_request_error: dataclasses.InitVar[bool | None] = None
    binary_reward: bool = True
    success_threshold: float = C.DEFAULT_SUCCESS_THRESHOLD
    keep_temp_video: bool = False  # transport: path only
    temp_video_dir: str | None = None  # transport: path only; must be readable by the proxy
    # -- additions ---------------------------------------------------------------------------
    # What a failed episode is rewarded with, chosen explicitly (counted in env/vlm_fallback):
    #   raise        stop the run with the typed error
    #   zero         a score of 0.0
    #   env_success  the simulator's success flag: run A's ground truth leaking into a VLM run,
    #                so never the default
    # None: zero. The seed's fail_on_request_error: true sets it to raise.
    fallback: Fallback | None = None
    # What an episode gets when the proxy's answer says its (run, backend, task) is in quality alarm
    # (the reward disagrees with the simulator's success beyond a bound: the policy may be hacking it),
    # marked in env/vlm_quality_alarm whatever the choice:
    #   keep    the VLM's score, as without the monitor
    #   native  the simulator's reward (as fallback: env_success), marked in env/vlm_fallback too
    #   raise   stop the run with QualityAlarmError
    on_quality_alarm: OnQualityAlarm = "keep"
    # The env's control rate: frames are sent with their real rate (fps = episode_fps x frames
    # sent / episode steps), whatever the transport; the proxy uses it when told to present
    # episodes in real time (its frames.presentation_fps: episode). LIBERO steps at 20 Hz.
    episode_fps: float = C.DEFAULT_EPISODE_FPS
    # inline: base64 frames_npy in a JSON body; binary: the same .npy as a raw part of a multipart
    # body (no base64; bench/bench_real_burst.py); path: a temp MP4 + video_path (shared disk)
    transport: Transport = "binary"
    client_sampling: bool = True  # send only the nframes frames picked here (the seed's way)
    # auto: with client_sampling (and no dense_points, no transport: path), the frames go as JPEGs
    # already at the size the backend sends them, made here with the proxy's own rules (GET
    # /frame-rules, fetched once), which the proxy forwards untouched: its per-frame decode, resize
    # and encode move to the env workers. Raw frames when OpenCV is missing here, the proxy is older
    # or its rules changed. raw: always raw frames (the proxy does that work).
    frame_encoding: FrameEncoding = "auto"
    buffer_frames: int = C.DEFAULT_BUFFER_FRAMES  # per env per episode; 0 = keep all (exact)
    frame_stride: int = 1  # keep every k-th step from the start (the buffer may widen it)
    max_concurrency: int = C.DEFAULT_MAX_CONCURRENCY
    max_retries: int = C.DEFAULT_MAX_RETRIES
    connect_timeout: float = C.DEFAULT_CONNECT_TIMEOUT
    batch: BatchMode = "auto"  # use POST /score/batch when the proxy has it
    # The run's identity is one name for three things: the proxy's monitor key (metadata.run), run
    # D's reference-store namespace and the run's scoring key's scope (a prefix of its names). It is
    # built from three keys (`identity`):
    #   run     the run's label (runD_srpo): the identity's prefix
    #   job     what tells this launch from another launch of the same run, identical in every env
    #           worker of the job: the shipped overlays set ${runner.logger.log_path}/seed=${env.train.seed}
    #           (RLinf's launcher gives every launch its own log path, and Hydra resolves it once for
    #           every worker); unset, the identity is the label alone, shared by every launch
    #   resume  an earlier job's identity, to carry on with its references and monitor windows
    run: str | None = None
    job: str | None = None
    resume: str | None = None
    # Dense progress (off: 0): ask the proxy's /score/dense for a curve of this many prefixes per
    # episode (k scoring calls each) instead of one score; the episode's reward is the curve's last
    # point, and `LiberoVLMReward.shaped_rewards` spreads it over the steps as potential differences.
    dense_points: int = 0
    # A second camera (off: None): the observation key of its images, e.g. `wrist_images` (RLinf's
    # LiberoEnv). Each episode then carries that view at the same steps, sent as `extra_view`; the
    # backend's frames.extra_view places it (a second video, or side by side in each frame), and a
    # backend without one refuses it (422). Raw frames for both views (the proxy composes them).
    extra_view: str | None = None
    # Where the reward comes from: `score` (a VLM's score per episode, POST /score) or `progress`
    # (run D: SRPO's self-referential progress, POST /progress/batch, docs/progress.md). With
    # progress a success pays as a score of 1, a failure progress x progress_coef (SRPO's 0.6),
    # and a failure with no reference (no success of its task to compare with) the native
    # reward (0) with on_no_reference: native, or the run stops (NoReferenceError) with raise.
    reward_source: RewardSource = "score"
    progress_coef: float = 0.6
    on_no_reference: OnNoReference = "native"
    # The proxy's bearer token (proxy.api_key_env); None = the VLM_REWARD_PROXY_API_KEY variable.
    api_key: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self, fail_on_request_error: bool | None) -> None:
        # A private read-only copy: no mutable default shared between configs.
        object.__setattr__(self, "backend_kwargs", MappingProxyType(dict(self.backend_kwargs or {})))
        object.__setattr__(self, "endpoint", str(self.endpoint).rstrip("/"))
        object.__setattr__(self, "fallback", self._fallback_with(fail_on_request_error))
        self._validate()

    def _fallback_with(self, fail_on_request_error: bool | None) -> Fallback | None:
        """`fallback`, with the seed's switch read into it: one policy, whichever key set it."""
        if fail_on_request_error is None:
            return self.fallback
        if not isinstance(fail_on_request_error, bool):
            # A quoted "false" is a true string: it would stop the run where the file says not to.
            raise RewardConfigError(f"reward_model: fail_on_request_error must be true or false (unquoted), "
                                    f"got {fail_on_request_error!r}")
        if fail_on_request_error and self.fallback not in (None, "raise"):
            raise RewardConfigError(f"reward_model: fail_on_request_error: true means fallback: raise, but fallback "
                                    f"is {self.fallback!r}; set only fallback")
        fallback = "raise" if fail_on_request_error else self.fallback
        log.warning("reward_model: fail_on_request_error is the seed's name for fallback: read as fallback: %s "
                    "(write that instead)", fallback or "unset (zero)")
        return fallback

    def _validate(self) -> None:
        problems = []
        if not self.endpoint.startswith(("http://", "https://")):
            problems.append(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        # A quoted "false" is a true string: a switch that is not a YAML boolean would turn the
        # reward model on, or keep thresholding scores, against what its value reads.
        for name in ("enable", "binary_reward", "keep_temp_video", "client_sampling"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false (unquoted), got {getattr(self, name)!r}")
        for name in ("timeout", "video_fps", "connect_timeout", "episode_fps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                problems.append(f"{name} must be a positive number, got {value!r}")
        for name, low in (("nframes", 1), ("max_pixels", 1), ("frame_stride", 1),
                          ("max_concurrency", 1), ("max_retries", 0), ("buffer_frames", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                problems.append(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.dense_points, int) or isinstance(self.dense_points, bool) or self.dense_points == 1 \
                or self.dense_points < 0:
            problems.append(f"dense_points must be 0 (off) or an integer >= 2, got {self.dense_points!r}")
        elif self.dense_points and self.extra_view:
            problems.append("extra_view (a second camera) is scored by /score, not /score/dense: set dense_points: 0")
        elif self.dense_points and self.binary_reward:
            problems.append("dense_points pays progress differences, which a thresholded score has not: "
                            "set binary_reward: false")
        problems.extend(self._progress_problems())
        threshold = self.success_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0.0 <= threshold <= 1.0:
            problems.append(f"success_threshold must be a number within [0, 1], got {threshold!r}")
        if self.transport not in ("inline", "path", "binary"):
            problems.append(f"transport must be 'inline', 'path' or 'binary', got {self.transport!r}")
        if self.frame_encoding not in ("auto", "raw"):
            problems.append(f"frame_encoding must be 'auto' or 'raw', got {self.frame_encoding!r}")
        if self.batch not in ("auto", "never"):
            problems.append(f"batch must be 'auto' or 'never', got {self.batch!r}")
        if self.fallback is not None and self.fallback not in FALLBACKS:
            problems.append(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if self.on_quality_alarm not in QUALITY_ALARM_POLICIES:
            problems.append(f"on_quality_alarm must be one of {', '.join(QUALITY_ALARM_POLICIES)}, "
                            f"got {self.on_quality_alarm!r}")
        if (isinstance(self.buffer_frames, int) and isinstance(self.nframes, int)
                and 0 < self.buffer_frames < 2 * self.nframes):
            problems.append(f"buffer_frames ({self.buffer_frames}) must be 0 or at least 2 x nframes "
                            f"({2 * self.nframes}) so sampling stays close to uniform")
        for name, longest in (("run", C.MAX_RUN_LABEL), ("resume", 256), ("job", 4096)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= longest):
                problems.append(f"{name} must be a non-empty string of at most {longest} characters, got {value!r}")
        if problems:
            raise RewardConfigError("reward_model: " + "; ".join(problems))

    def _progress_problems(self) -> list[str]:
        problems = []
        coef = self.progress_coef
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0.0 <= coef <= 1.0:
            problems.append(f"progress_coef must be a number within [0, 1], got {coef!r}")
        if self.on_no_reference not in ("native", "raise"):
            problems.append(f"on_no_reference must be 'native' or 'raise', got {self.on_no_reference!r}")
        if self.reward_source not in ("score", "progress"):
            problems.append(f"reward_source must be 'score' or 'progress', got {self.reward_source!r}")
        elif self.reward_source == "progress":
            if self.dense_points:
                problems.append("reward_source: progress pays one progress per episode from /progress/batch; "
                                "dense_points asks /score/dense for a curve: set dense_points: 0")
            if self.binary_reward:
                problems.append("reward_source: progress pays a continuous progress, which a threshold would "
                                "erase: set binary_reward: false")
            if self.backend_kwargs:
                problems.append("reward_source: progress sends no backend_kwargs (an embedding backend has no "
                                "prompt or score_mode): set backend_kwargs: {}")
        return problems

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, mapping: Any = None, **overrides: Any) -> RewardModelConfig:
        """From a dict or an OmegaConf node (RLinf's `env.train.reward_model`); None = defaults."""
        data = _to_plain(mapping) if mapping is not None else {}
        if not isinstance(data, dict):
            raise RewardConfigError(f"reward_model must be a mapping, got {type(mapping).__name__}")
        data.update(overrides)
        known = set(RewardModelOptions.__annotations__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise RewardConfigError(f"reward_model: unknown key(s) {', '.join(unknown)}; "
                                    f"known: {', '.join(sorted(known))}")
        if data.get("backend_kwargs") is None:
            data.pop("backend_kwargs", None)
        for name in ("timeout", "video_fps", "connect_timeout", "success_threshold", "episode_fps", "progress_coef"):
            if isinstance(data.get(name), int) and not isinstance(data.get(name), bool):
                data[name] = float(data[name])
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, key: str | None = "reward_model") -> RewardModelConfig:
        """From a YAML file; `key` is a dotted path to the block (None = the whole file)."""
        data: Any = strict_yaml.load(Path(path).read_text()) or {}
        for part in (key.split(".") if key else []):
            if not isinstance(data, dict) or part not in data:
                raise RewardConfigError(f"{path}: no {key!r} block")
            data = data[part]
        return cls.from_mapping(data)

    def replace(self, **changes: Any) -> RewardModelConfig:
        # The seed's switch is already in `fallback`: read again, it would log its line again.
        changes.setdefault("fail_on_request_error", None)
        return dataclasses.replace(self, **changes)

    # -- the run's identity ----------------------------------------------------------------------
    @property
    def identity(self) -> str | None:
        """The one name of this job's run (metadata.run, the reference namespace): `resume` when
        set; else `run` and a digest of `job` (`runD_srpo-3f2a9c01d4`: a new launch, a new name;
        every worker of one launch, the same); else `run` alone; None without any of them."""
        if self.resume is not None:
            return self.resume
        if self.job is None:
            return self.run
        digest = hashlib.sha256(self.job.encode()).hexdigest()[:C.RUN_DIGEST_CHARS]
        return f"{self.run or 'run'}-{digest}"

    # -- derived URLs ----------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """The proxy's root URL: `endpoint` without its /score suffix."""
        if self.endpoint.endswith(C.SCORE_PATH):
            return self.endpoint[: -len(C.SCORE_PATH)]
        return self.endpoint

    @property
    def score_url(self) -> str:
        """Where one episode goes: /score, or /score/dense for a curve (dense_points)."""
        return self.base_url + (C.DENSE_PATH if self.dense_points else C.SCORE_PATH)

    @property
    def batch_url(self) -> str:
        return self.base_url + C.BATCH_PATH

    @property
    def progress_url(self) -> str:
        return self.base_url + C.PROGRESS_BATCH_PATH

    @property
    def health_url(self) -> str:
        return self.base_url + C.HEALTH_PATH

    @property
    def frame_rules_url(self) -> str:
        return self.base_url + C.FRAME_RULES_PATH

    @property
    def failure_policy(self) -> Fallback:
        """What a failed episode gets (`fallback`, set by it or by the seed's fail_on_request_error)."""
        return self.fallback or "zero"

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(C.API_KEY_ENV) or None


# Code written for the seed reads `config.fail_on_request_error`; the dataclass keeps no such field
# (it is an InitVar, read into `fallback`), so the name answers from `fallback` instead.
RewardModelConfig.fail_on_request_error = property(  # type: ignore[assignment]
    lambda self: self.fallback == "raise", doc="The seed's name for `fallback == 'raise'`.")


class RewardModelOptions(TypedDict, total=False):
    """The `reward_model` keys with their types: what the clients take as keyword arguments.
    `RewardModelConfig` has the defaults and the meaning of each (tests/client/test_config.py keeps
    the two lists equal)."""

    enable: bool
    endpoint: str
    timeout: float
    nframes: int
    max_pixels: int
    backend: str | None
    backend_kwargs: Mapping[str, Any]
    video_fps: float
    fail_on_request_error: bool | None
    binary_reward: bool
    success_threshold: float
    keep_temp_video: bool
    temp_video_dir: str | None
    fallback: Fallback | None
    on_quality_alarm: OnQualityAlarm
    episode_fps: float
    transport: Transport
    client_sampling: bool
    frame_encoding: FrameEncoding
    buffer_frames: int
    frame_stride: int
    max_concurrency: int
    max_retries: int
    connect_timeout: float
    batch: BatchMode
    run: str | None
    job: str | None
    resume: str | None
    dense_points: int
    extra_view: str | None
    reward_source: RewardSource
    progress_coef: float
    on_no_reference: OnNoReference
    api_key: str | None


def _to_plain(node: Any) -> Any:
    """Dict/list trees to plain Python. OmegaConf's DictConfig and ListConfig are a Mapping and a
    Sequence whose item access resolves interpolations, so OmegaConf itself is not imported."""
    if isinstance(node, Mapping):
        return {str(k): _to_plain(v) for k, v in node.items()}
    if isinstance(node, Sequence) and not isinstance(node, str | bytes):
        return [_to_plain(v) for v in node]
    return node
