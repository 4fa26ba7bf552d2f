"""The one validated configuration model: the proxy, its backends and cascades (loading.py reads a
YAML file into it).

Defaults live here and nowhere else, but for a backend's `launch` section (how `up` starts its
servers: proxy/config/launch.py). Every model forbids unknown keys (proxy/config/strict.py), so a
typo fails at start-up with the dotted path of the bad key.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from proxy.answers.scales import SCORE_MODES
from proxy.config.calls import (
    AdmissionConfig,
    CircuitConfig,
    RetryConfig,
    RoutingConfig,
)
from proxy.config.cascades import CascadeConfig
from proxy.config.endpoint_hosts import EndpointHost
from proxy.config.endpoint_urls import endpoint_url, split_credentials
from proxy.config.launch import LaunchConfig
from proxy.config.quality import QualityConfig
from proxy.config.run_keys import RunKeyConfig
from proxy.config.stores import AuditConfig, FrameStoreConfig, ReferenceStoreConfig
from proxy.config.strict import PositiveInt
from proxy.config.strict import StrictModel as _Strict
from proxy.config.video_decoders import VideoDecodersConfig
from vlm_protocol.frames import IMAGE_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, VIDEO_TOTAL_PIXELS

log = logging.getLogger(__name__)

Layout = Literal["qwen_video", "primo_interleave", "images", "shuffled_images"]
ScoreMode = Literal[SCORE_MODES]  # meanings in proxy/answers/scales.py
class ProxySettings(_Strict):
    renamed = {"max_nframes": "nframes_limit"}
    section = "proxy."

    host: str = "127.0.0.1"
    port: int = Field(18080, ge=0, le=65535)
    # video_path is only read under these roots (after resolving symlinks); empty = no paths.
    allowed_media_roots: list[Path] = Field(default_factory=list)
    max_body_mb: float = Field(64.0, gt=0)
    # Caps on what one request may ask for, whatever the backend defaults say: a `*_limit` refuses a
    # request above it (422), where a backend's frames.clamp_nframes_to lowers it.
    nframes_limit: PositiveInt = 128
    max_inline_frames: PositiveInt = 2048
    max_pixels_limit: PositiveInt = 1_605_632  # 2048 * 28 * 28
    max_source_pixels: PositiveInt = 4096 * 4096  # decoded frame size cap (decompression bombs)
    # Per request (docs/configuration.md): decoded MiB held at once, a video's frames and seconds.
    max_decoded_mb: float = Field(512.0, gt=0)
    max_video_frames: PositiveInt = 4096
    max_video_seconds: float = Field(600.0, gt=0)
    media_workers: PositiveInt | None = None  # media threads; None: the cores, at most 8
    # Video files are decoded in supervised worker processes, one per media thread (proxy/media/decoder_pool.py).
    video_decoders: VideoDecodersConfig = Field(default_factory=VideoDecodersConfig)
    prompts_dir: Path = Path("prompts")
    audit_log: Path | None = None
    audit: AuditConfig = Field(default_factory=AuditConfig)  # rotation and queue of audit_log
    frame_store: FrameStoreConfig | None = None  # opt-in; the audit log names each frame by hash
    reference_store: ReferenceStoreConfig | None = None  # opt-in (POST /progress/batch)
    # Bounded wait for a backend's /health and /v1/models when /health is asked.
    health_timeout_s: float = Field(2.0, gt=0)
    # Background readiness polling of every endpoint (closes circuits of recovered replicas).
    health_interval_s: float = Field(5.0, gt=0)
    max_batch_items: PositiveInt = 512  # POST /score/batch
    max_prompt_chars: PositiveInt = 16_384  # backend_kwargs system_prompt / user_prompt / prompt_template
    # Name of the env var holding a bearer token required on every route but /health.
    api_key_env: str | None = None
    # The admin key's env var: the only key of routes that change what the proxy trusts or pays
    # (proxy/http/admin_access.py); unset = those routes are off. It may also score; not the scoring key.
    admin_api_key_env: str | None = None
    admin_endpoint_hosts: list[EndpointHost] | None = None  # what POST /admin/endpoints may add; None: any
    # Scoring keys limited to some runs (proxy/config/run_keys.py): each writes only its runs' episodes,
    # ground truth and references. With any, every route but /health needs a key.
    run_keys: list[RunKeyConfig] = Field(default_factory=list)
    # On SIGTERM/SIGINT: requests in flight get this long, then are answered 503 shutting_down.
    shutdown_grace_s: float = Field(10.0, ge=0, le=600)

    @model_validator(mode="after")
    def _admin_key_is_not_the_scoring_key(self) -> ProxySettings:
        if self.admin_api_key_env is not None and self.admin_api_key_env == self.api_key_env:
            raise ValueError("admin_api_key_env must name another variable than api_key_env: with one key, "
                             "every scoring client would be an admin")
        names = [self.api_key_env, self.admin_api_key_env, *(k.key_env for k in self.run_keys)]
        named = [n for n in names if n is not None]
        if len(set(named)) != len(named):
            raise ValueError("api_key_env, admin_api_key_env and each run_keys[].key_env must name different "
                             "variables: one key would hold two sets of rights")
        return self


class SamplingConfig(_Strict):
    """Sent explicitly on every request: vLLM fills omitted fields from generation_config.json."""

    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 = disabled in vLLM
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    max_tokens: PositiveInt = 64
    seed: int | None = 0


class FramesConfig(_Strict):
    """Which frames go to the model, at what size and what rate (vlm_protocol.frames has the rules).

    The pixel keys say what they bound: `max_pixels` is the per-frame budget of every frame (the
    request's `max_pixels` when it gives one); `video_*` bound the frames of the video, `image_*`
    the still images.
    """

    renamed = {"max_nframes": "clamp_nframes_to", "min_pixels": "video_min_pixels",
               "total_pixels": "video_total_pixels"}
    section = "frames."

    nframes: PositiveInt = 16
    # Requests for more frames are lowered to this and say so (PRIMO-R1's evaluation: 22).
    clamp_nframes_to: PositiveInt | None = None
    # Per-frame budget, with qwen-vl-utils' meaning: it lowers the video rule's per-frame cap.
    max_pixels: PositiveInt = 200_704  # 256 * 28 * 28
    video_min_pixels: PositiveInt = VIDEO_MIN_PIXELS  # qwen-vl-utils: 128 * 28 * 28
    video_max_pixels: PositiveInt = VIDEO_MAX_PIXELS
    video_total_pixels: PositiveInt = VIDEO_TOTAL_PIXELS  # across all frames of one video
    image_min_pixels: PositiveInt = IMAGE_MIN_PIXELS  # still images (PRIMO's first and last frame)
    jpeg_quality: int = Field(90, ge=1, le=100)
    # The fps vLLM is told, the same whatever carries the frames (MP4 path, frames, frames_npy):
    #   seed    the request's video_fps (the seed's client: 4), default_video_fps if absent;
    #   episode the real rate of the frames sent (source fps x frames sent / source frames);
    #   a number that rate.
    presentation_fps: Literal["seed", "episode"] | Annotated[float, Field(gt=0)] = "seed"
    default_video_fps: float = Field(4.0, gt=0)  # the seed's reward_model.video_fps
    # Rate of inline frames when the request gives no fps (presentation_fps: episode only).
    default_source_fps: float = Field(4.0, gt=0)
    # A second camera (the request's extra_view, e.g. LIBERO's wrist view), taken at the main view's
    # frame indices; every request to the backend must carry one (proxy/media/views.py):
    #   second_video  its own video part after the main one, at the same budget (twice the vision tokens);
    #   side_by_side  each frame the two views side by side, each at half the pixel budget (about the
    #                 tokens of one view).
    # None: one camera, and a request with extra_view is refused.
    extra_view: Literal["second_video", "side_by_side"] | None = None


class BackendConfig(_Strict):
    model: str  # the served-model-name
    # chat: /chat/completions scores (/score, /compare, ...). embedding: /embeddings vectors for
    # POST /progress/batch (docs/progress.md); `up` starts its servers with the pooling flags.
    kind: Literal["chat", "embedding"] = "chat"
    aliases: list[str] = Field(default_factory=list)
    endpoints: list[str] = Field(min_length=1)  # OpenAI base URLs, e.g. http://127.0.0.1:8001/v1
    api_key_env: str | None = None  # name of the env var holding the bearer token
    # Required for chat; an embedding backend's default is qwen_video (the frames as one video part).
    layout: Layout | None = None
    # Required for chat; an embedding backend sends the template's text beside the video when set.
    prompt: str | None = None
    sampling: SamplingConfig = SamplingConfig()
    max_tokens_limit: PositiveInt = 4096  # cap for per-request max_tokens overrides
    frames: FramesConfig = FramesConfig()
    score_mode: ScoreMode = "auto"
    retry: RetryConfig = RetryConfig()
    circuit: CircuitConfig = CircuitConfig()
    admission: AdmissionConfig = AdmissionConfig()
    routing: RoutingConfig = RoutingConfig()
    # Per-request media_io_kwargs need `vllm serve --trust-request-mm-kwargs`. Turning this off
    # is for servers started without it: vLLM then keeps at most its --media-io-kwargs
    # num_frames (32 by default) and assumes fps 1.
    request_mm_kwargs: bool = True
    # Each image and video part carries vLLM's `uuid` (>= 0.10.2), its content hash, beside its data
    # (proxy/prompting/layouts.py). Off: parts as before, vLLM hashes the bytes itself.
    media_uuids: bool = True
    # When set, requests whose estimated prompt + max_tokens exceed it fail before sending.
    max_model_len: PositiveInt | None = None
    launch: LaunchConfig | None = None

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_http(cls, v: list[str]) -> list[str]:
        return [endpoint_url(url) for url in v]

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("kind") == "embedding" and data.get("layout") is None:
            return {**data, "layout": "qwen_video"}
        return data

    @model_validator(mode="after")
    def _chat_needs_prompt(self) -> BackendConfig:
        if self.api_key_env and any(split_credentials(url)[1] for url in self.endpoints):
            raise ValueError("an endpoint URL with user:password@ and api_key_env would both set the "
                             "Authorization header: give the server's key in api_key_env only")
        if self.kind == "chat":
            missing = [key for key in ("layout", "prompt") if getattr(self, key) is None]
            if missing:
                raise ValueError(f"a chat backend needs {' and '.join(missing)} (kind: embedding needs neither)")
        if self.frames.extra_view == "second_video" and self.layout not in ("qwen_video", "primo_interleave"):
            raise ValueError(f"frames.extra_view second_video needs a layout with a video (qwen_video, "
                             f"primo_interleave), not {self.layout}; side_by_side works with every layout")
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class Settings(_Strict):
    proxy: ProxySettings = ProxySettings()
    backends: dict[str, BackendConfig] = Field(min_length=1)
    cascades: dict[str, CascadeConfig] = Field(default_factory=dict)  # backends asked in turn (cascades.py)
    quality: QualityConfig = Field(default_factory=QualityConfig)  # the live reward-quality monitor

    @model_validator(mode="after")
    def _names_unique(self) -> Settings:
        seen: dict[str, str] = {}
        named = [(name, [name, *b.aliases]) for name, b in self.backends.items()]
        named += [(name, [name, *c.aliases]) for name, c in self.cascades.items()]
        for name, labels in named:
            for label in labels:
                if label in seen and seen[label] != name:
                    raise ValueError(f"name {label!r} is used by {seen[label]!r} and {name!r}")
                seen[label] = name
        return self

    @model_validator(mode="after")
    def _shared_replicas_share_one_pool(self) -> Settings:
        """Backends that name the same replica share its pool (admission, circuits, calls in flight),
        so a cascade's two stages on one replica never book it twice: they must name the same
        endpoints and configure the pool alike."""
        by_url: dict[str, str] = {}
        for name, backend in self.backends.items():
            for url in backend.endpoints:
                other = by_url.setdefault(split_credentials(url)[0], name)
                if other == name:
                    continue
                first = self.backends[other]
                if [split_credentials(u)[0] for u in first.endpoints] != [split_credentials(u)[0]
                                                                         for u in backend.endpoints]:
                    continue  # not one pool: warnings() says so
                for key in ("admission", "circuit", "routing"):
                    if getattr(first, key) != getattr(backend, key):
                        raise ValueError(f"backends {other!r} and {name!r} share their replicas (one pool) but "
                                         f"configure its {key} differently: give them the same {key}")
        return self

    @model_validator(mode="after")
    def _cascade_stages_fit(self) -> Settings:
        labels = {label: name for name, b in self.backends.items() for label in (name, *b.aliases)}
        for name, cascade in self.cascades.items():
            stages = []
            for index, stage in enumerate(cascade.stages):
                backend = self.backends.get(labels.get(stage.backend, ""))
                where = f"cascades.{name}.stages[{index}]"
                if backend is None:
                    raise ValueError(f"{where}.backend {stage.backend!r} is not a backend of this config")
                if backend.kind != "chat" or backend.layout not in ("qwen_video", "primo_interleave"):
                    raise ValueError(f"{where}: {stage.backend!r} must be a chat backend with a video layout "
                                     "(qwen_video or primo_interleave): the stages share one decode of the episode")
                stages.append(backend)
            # The frames are the decoding stage's (its clamp too), so what makes a sent frame must agree.
            first = stages[0].frames.model_dump(exclude={"clamp_nframes_to"})
            for index, backend in enumerate(stages[1:], start=1):
                differ = sorted(k for k, v in backend.frames.model_dump(exclude={"clamp_nframes_to"}).items()
                                if first[k] != v)
                if differ:
                    raise ValueError(f"cascades.{name}.stages[{index}]: frames.{', frames.'.join(differ)} differ from "
                                     "stages[0]'s; the episode is decoded once for every stage, so give them the same")
        return self

    def proxy_api_key(self) -> str | None:
        env = self.proxy.api_key_env
        return os.environ.get(env) or None if env else None

    def proxy_admin_key(self) -> str | None:
        env = self.proxy.admin_api_key_env
        return os.environ.get(env) or None if env else None

    def proxy_run_keys(self) -> list[tuple[str | None, RunKeyConfig]]:
        """Each run key's value (None when its variable is unset or empty) with its entry."""
        return [(os.environ.get(k.key_env) or None, k) for k in self.proxy.run_keys]

    def warnings(self) -> list[str]:
        said = [
            f"backend {name!r}: request_mm_kwargs is off; vLLM will use its server defaults "
            "(at most --media-io-kwargs num_frames, 32 unless set, and fps 1.0)"
            for name, backend in self.backends.items()
            if not backend.request_mm_kwargs
        ]
        lists = {name: [split_credentials(u)[0] for u in b.endpoints] for name, b in self.backends.items()}
        for first, second in itertools.combinations(lists, 2):
            shared = sorted(set(lists[first]) & set(lists[second]))
            if shared and lists[first] != lists[second]:
                said.append(f"backends {first!r} and {second!r} share {', '.join(shared)} but not all their endpoints: "
                            "each counts its own calls in flight there (one pool needs the same endpoint list)")
        return said
