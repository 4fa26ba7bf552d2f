"""A /score request's effective settings: backend defaults, per-request overrides within the
caps, the seed's prompt kwargs, the frame cap, the presentation rate, and what a re-ask sends."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from proxy.answers.constraints import answer_regex
from proxy.answers.estimate import REDUCTIONS, Estimate, single_token_values
from proxy.answers.parse import AnswerSpec
from proxy.answers.scales import SCORE_MODES, scale_for_mode
from proxy.config import BackendConfig, ProxySettings, SamplingConfig
from proxy.errors import FrameRulesChanged, InvalidRequest, PromptTemplateError
from proxy.media.encode import EncodedFrames, FrameLimits
from proxy.prompting.layouts import layout_has_images, layout_has_stills
from proxy.prompting.templates import SEED_PROMPT_KWARGS, PromptTemplate
from proxy.protocol.score import ScoreRequest
from vlm_protocol.frame_rules import FrameRules

__all__ = ["ResolvedRequest", "frame_limits", "frame_rules_of", "presentation_fps", "resolve_request",
           "sampling_for_ask"]

SAMPLING_FIELDS = frozenset(SamplingConfig.model_fields)
MIN_MAX_PIXELS = 28 * 28  # the smallest per-frame budget a request may ask for (the seed's bound)
MAX_SAMPLES = 16  # n per request: k decodes share one prefill, but each costs its max_tokens
TOP_LOGPROBS = 20  # vLLM's default cap (--max-logprobs) is 20
ESTIMATE_KWARGS = ("constrain", "samples", "reduce", "quorum", "logprob_score")


@dataclass(frozen=True)
class ResolvedRequest:
    """A request's effective settings after defaults, caps and backend_kwargs."""

    sampling: SamplingConfig
    score_mode: str
    answer: AnswerSpec  # the template's answer on the score_mode's scale (what is parsed and constrained)
    variables: dict[str, Any]
    prompt_overrides: dict[str, str]  # the seed's system_prompt / user_prompt / prompt_template
    limits: FrameLimits
    requested_nframes: int
    estimate: Estimate
    upstream_fields: dict[str, Any]  # what the estimate adds to the chat body (n, structured_outputs, logprobs)
    shuffle_seed: int | None = None  # a per-frame answer's seed of the shown order (None: from the frames)


def split_backend_kwargs(kwargs: dict[str, Any], template: Any, *, own: tuple[str, ...] = (),
                         own_words: str = "") -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A request's backend_kwargs by what each sets: sampling fields, the route's `own` keys, and
    the template's variables (in that order of precedence); any other key is a 422 naming what
    the route accepts. `template` has `name` and `variable_names`."""
    sampling, variables, owned = {}, {}, {}
    for key, value in kwargs.items():
        if key in SAMPLING_FIELDS:
            sampling[key] = value
        elif key in own:
            owned[key] = value
        elif key in template.variable_names and key != "task_text":
            variables[key] = value
        else:
            raise _not_accepted(key, template, own_words)
    return sampling, variables, owned


def _not_accepted(key: str, template: Any, own_words: str) -> InvalidRequest:
    others = ", ".join(sorted(template.variable_names - {"task_text"})) or "none"
    fields = ", ".join(sorted(SAMPLING_FIELDS))
    own = f"{own_words}, " if own_words else ""
    return InvalidRequest(f"backend_kwargs.{key} is not a sampling field ({fields}), {own}"
                          f"or a variable of prompt {template.name!r} ({others})", field=f"backend_kwargs.{key}")


def resolve_request(request: ScoreRequest, cfg: BackendConfig, template: PromptTemplate,
                proxy: ProxySettings) -> ResolvedRequest:
    limits, requested = frame_limits(request, cfg, proxy)
    prompt_overrides, score_mode, estimate_kwargs = {}, cfg.score_mode, {}
    shuffle_seed: int | None = None
    if (cfg.layout == "shuffled_images") != bool(template.answer.per_frame):
        raise PromptTemplateError(f"prompt {template.name!r} and layout {cfg.layout!r} do not fit: a per_frame answer "
                                  "(one value per shown frame) goes with layout shuffled_images, and only it")
    own_words = f"score_mode, {', '.join(ESTIMATE_KWARGS)}, one of the seed's {', '.join(SEED_PROMPT_KWARGS)}"
    overrides, variables, own = split_backend_kwargs(
        request.backend_kwargs, template, own=("score_mode", *ESTIMATE_KWARGS, "shuffle_seed", *SEED_PROMPT_KWARGS),
        own_words=own_words)
    for key, value in own.items():
        if key == "score_mode":
            if value not in SCORE_MODES:
                raise InvalidRequest(f"score_mode must be one of {', '.join(SCORE_MODES)}",
                                     field="backend_kwargs.score_mode")
            score_mode = value
        elif key in ESTIMATE_KWARGS:
            estimate_kwargs[key] = value
        elif key == "shuffle_seed":
            if not template.answer.per_frame:
                raise _not_accepted(key, template, own_words)
            if type(value) is not int or not 0 <= value < 2**63:
                raise _kwarg_error(key, "must be a non-negative integer (the seed of the frames' shown order)")
            shuffle_seed = value
        elif template.answer.per_frame:
            raise _kwarg_error(key, f"cannot replace prompt {template.name!r}'s text: its user text places the shown "
                                    "frames")
        else:
            if not isinstance(value, str) or len(value) > proxy.max_prompt_chars:
                raise InvalidRequest(f"backend_kwargs.{key} must be a string of at most "
                                     f"{proxy.max_prompt_chars} characters (proxy.max_prompt_chars)",
                                     field=f"backend_kwargs.{key}")
            prompt_overrides[key] = value
    sampling = _override_sampling(cfg, overrides)
    if template.answer.per_frame and score_mode != "auto":
        raise InvalidRequest(f"prompt {template.name!r} answers one value per frame on its declared scale: leave "
                             "score_mode auto", field="backend_kwargs.score_mode")
    if template.answer.per_frame and set(estimate_kwargs) - {"constrain"}:
        raise _kwarg_error(sorted(set(estimate_kwargs) - {"constrain"})[0],
                           f"does not apply to prompt {template.name!r}: one reply holds every frame's value")
    if template.answer.probability:
        _probability_only(template.name, score_mode, estimate_kwargs)
        sampling = sampling.model_copy(update={"max_tokens": 1})  # the first token's logprobs are the answer
        answer = template.answer
    else:
        answer = replace(template.answer, scale=scale_for_mode(score_mode, template.answer.scale))
    estimate = _estimate(estimate_kwargs, template.name, answer, sampling, "temperature" in overrides)
    return ResolvedRequest(sampling=sampling, score_mode=score_mode, answer=answer, variables=variables,
                           prompt_overrides=prompt_overrides, limits=limits, requested_nframes=requested,
                           estimate=estimate, upstream_fields=_upstream_fields(estimate, answer),
                           shuffle_seed=shuffle_seed)


_RULES_IDS: dict[int, tuple[BackendConfig, str]] = {}  # id(config) → (config, its rules id): per request


def _rules_id(cfg: BackendConfig) -> str:
    held = _RULES_IDS.get(id(cfg))
    if held is None or held[0] is not cfg:  # the config is held too, so its id is never another's
        held = _RULES_IDS[id(cfg)] = (cfg, frame_rules_of("", cfg).rules_id)
    return held[1]


def frame_rules_of(name: str, cfg: BackendConfig) -> FrameRules:
    """The backend's frame rules as GET /frame-rules publishes them (and `frame_limits` applies)."""
    frames = cfg.frames
    # The wire keeps qwen-vl-utils' names (clients read them); the config's names say what each bounds.
    return FrameRules(backend=name, layout=cfg.layout or "", nframes=frames.nframes,
                      max_nframes=frames.clamp_nframes_to, max_pixels=frames.max_pixels,
                      min_pixels=frames.video_min_pixels,
                      video_max_pixels=frames.video_max_pixels, total_pixels=frames.video_total_pixels,
                      image_min_pixels=frames.image_min_pixels, stills=layout_has_stills(cfg.layout or ""),
                      jpeg_quality=frames.jpeg_quality)


def frame_limits(request: ScoreRequest, cfg: BackendConfig, proxy: ProxySettings) -> tuple[FrameLimits, int]:
    """Which frames of the request go upstream, at what size (and the nframes asked for): the
    backend's defaults, the request's own nframes and max_pixels within the caps."""
    if request.frame_rules is not None:
        current = _rules_id(cfg)
        if request.frame_rules != current:
            raise FrameRulesChanged(f"the frames were encoded for frame rules {request.frame_rules}; the backend's "
                                    f"are {current} now (GET /frame-rules): send the raw frames",
                                    field="frame_rules", current=current)
    if request.frame_rules is not None and request.stills is None and layout_has_stills(cfg.layout or ""):
        raise InvalidRequest("frames encoded for this backend's rules come with its stills (the first and last frame "
                             "at the image rule's size, GET /frame-rules): stills made here from final-size frames "
                             "would be another size than the raw frames give", field="stills")
    if request.stills is not None and not layout_has_stills(cfg.layout or ""):
        raise InvalidRequest(f"the backend's layout ({cfg.layout}) sends no still images: send no stills",
                             field="stills")
    if request.stills is not None and request.prefix_end is not None:
        raise InvalidRequest("stills are the episode's own first and last frame: they cannot go with prefix_end",
                             field="stills")
    requested = request.nframes or cfg.frames.nframes
    if requested > proxy.nframes_limit:
        raise InvalidRequest(f"nframes {requested} is over the cap of {proxy.nframes_limit}",
                             field="nframes")
    # A model trained or evaluated with at most N frames gets at most N (PRIMO-R1: 22).
    nframes = min(requested, cfg.frames.clamp_nframes_to or requested)
    if layout_has_images(cfg.layout or "") and nframes > cfg.frames.nframes:
        # One image part per frame: the server's --limit-mm-per-prompt image count is frames.nframes.
        raise InvalidRequest(f"backend uses the {cfg.layout} layout, one image per frame; its servers take at most "
                             f"frames.nframes={cfg.frames.nframes} images (--limit-mm-per-prompt)",
                             field="nframes")
    if cfg.layout == "shuffled_images" and nframes < 2:
        raise InvalidRequest("the shuffled_images layout shows the first frame as the reference and at least one "
                             "frame after it: nframes must be at least 2", field="nframes")
    max_pixels = request.max_pixels or cfg.frames.max_pixels
    if not MIN_MAX_PIXELS <= max_pixels <= proxy.max_pixels_limit:
        raise InvalidRequest(f"max_pixels must be within [{MIN_MAX_PIXELS}, "
                             f"{proxy.max_pixels_limit}], got {max_pixels}", field="max_pixels")
    frames = cfg.frames
    limits = FrameLimits(
        nframes=nframes, max_pixels=max_pixels, min_pixels=frames.video_min_pixels,
        video_max_pixels=frames.video_max_pixels, total_pixels=frames.video_total_pixels,
        image_min_pixels=frames.image_min_pixels, stills=layout_has_stills(cfg.layout),
        jpeg_quality=frames.jpeg_quality, default_source_fps=frames.default_source_fps,
        max_inline_frames=proxy.max_inline_frames, max_source_pixels=proxy.max_source_pixels)
    return limits, requested


def presentation_fps(cfg: BackendConfig, request: ScoreRequest, frames: EncodedFrames) -> float:
    """The rate vLLM is told, by the backend's frames.presentation_fps (the same for every
    transport: a path, frames or frames_npy carrying one episode give one body)."""
    policy = cfg.frames.presentation_fps
    if policy == "seed":
        return request.video_fps or cfg.frames.default_video_fps
    if policy == "episode":
        return frames.sampled_fps
    return float(policy)


def sampling_for_ask(cfg: BackendConfig, sampling: SamplingConfig, parse_round: int) -> dict[str, Any]:
    """The sampling fields of ask `parse_round` (0 = the first ask). A re-ask samples (so greedy
    decoding cannot repeat the unparseable reply) with the next seed."""
    fields = sampling.model_dump(exclude_none=True)
    if parse_round == 0:
        return fields
    reask = cfg.retry.reask
    fields["temperature"], fields["top_p"] = reask.temperature, reask.top_p
    if sampling.seed is not None:
        fields["seed"] = sampling.seed + parse_round
    return fields


def _override_sampling(cfg: BackendConfig, overrides: dict[str, Any]) -> SamplingConfig:
    if not overrides:
        return cfg.sampling
    for key, value in overrides.items():  # JSON numbers: lax mode would read false as 0.0 and "1" as 1
        if isinstance(value, bool | str):
            raise InvalidRequest(f"backend_kwargs.{key} must be a number", field=f"backend_kwargs.{key}")
    try:
        sampling = SamplingConfig.model_validate({**cfg.sampling.model_dump(), **overrides})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"backend_kwargs.{key}: {first['msg']}", field=f"backend_kwargs.{key}") from None
    if sampling.max_tokens > cfg.max_tokens_limit:
        raise InvalidRequest(f"backend_kwargs.max_tokens is over the cap of {cfg.max_tokens_limit}",
                             field="backend_kwargs.max_tokens")
    return sampling


def _kwarg_error(key: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"backend_kwargs.{key} {message}", field=f"backend_kwargs.{key}")


def _whole_number(value: Any) -> int | None:
    """An int, or a float with no fraction (JSON's 8.0 is the integer 8, as pydantic reads it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if float(value).is_integer() else None


def _estimate(kwargs: dict[str, Any], prompt: str, answer: AnswerSpec, sampling: SamplingConfig,
              temperature_sent: bool) -> Estimate:
    """samples / reduce / quorum / logprob_score / constrain, checked against each other."""
    for key in ("constrain", "logprob_score"):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise _kwarg_error(key, "must be true or false")
    samples = _whole_number(kwargs.get("samples", 1))
    if samples is None or not 1 <= samples <= MAX_SAMPLES:
        raise _kwarg_error("samples", f"must be an integer from 1 to {MAX_SAMPLES}")
    # The temperature k replies are sampled at is the caller's to state, as the API document says: a
    # backend's default (greedy, or PRIMO-R1's 0.01) gives k copies of one reply and a spread of 0.
    if samples > 1 and (not temperature_sent or sampling.temperature == 0):
        raise _kwarg_error("samples", "needs a temperature > 0 sent with it (greedy or near-greedy decoding gives "
                                      "k copies of one reply): add backend_kwargs.temperature")
    reduce = kwargs.get("reduce", "median")
    if reduce not in REDUCTIONS:
        raise _kwarg_error("reduce", f"must be one of {', '.join(REDUCTIONS)}")
    quorum = _whole_number(kwargs.get("quorum", (samples + 1) // 2))
    if quorum is None or not 1 <= quorum <= samples:
        raise _kwarg_error("quorum", f"must be an integer from 1 to samples ({samples})")
    logprob = kwargs.get("logprob_score", False)
    if logprob and samples > 1:
        raise _kwarg_error("logprob_score", "and samples > 1 are two estimators: choose one")
    if logprob and single_token_values(answer) is None:
        raise _kwarg_error("logprob_score", f"needs a single-token scale (0-9 or binary); prompt {prompt!r} "
                                            f"answers on {answer.scale.name} (score_mode included), whose values "
                                            "span several tokens: use samples instead")
    return Estimate(samples=samples, reduce=reduce, quorum=quorum, logprob=logprob,
                    constrain=kwargs.get("constrain", answer.constrain))


def _probability_only(prompt: str, score_mode: str, kwargs: dict[str, Any]) -> None:
    """A probability answer is read from the first token's logprobs: no other estimator, scale or
    constraint applies (a constraint would change the number: vLLM masks the logits first)."""
    if score_mode != "auto":
        raise InvalidRequest(f"prompt {prompt!r} answers a probability (P of its affirmative token): score_mode "
                             f"{score_mode!r} has no meaning here; leave it auto", field="backend_kwargs.score_mode")
    for key, value in kwargs.items():
        if value is not False and not (key == "samples" and value == 1 and value is not True):
            raise _kwarg_error(key, f"does not apply to prompt {prompt!r}: its score is the probability of its "
                                    "affirmative token, read from one token's logprobs")


def _upstream_fields(estimate: Estimate, answer: AnswerSpec) -> dict[str, Any]:
    if answer.probability:
        # + logprob_token_ids, per endpoint (its /tokenize numbers the words): proxy/upstream/answer_tokens.py
        return {"n": 1, "logprobs": True, "return_tokens_as_token_ids": True}
    fields: dict[str, Any] = {"n": estimate.samples}
    if estimate.constrain and not answer.per_frame:  # a per-frame one: by the frames shown (pipelines/scoring.py)
        fields["structured_outputs"] = {"regex": answer_regex(answer)}
    if estimate.logprob:
        fields.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
    return fields
