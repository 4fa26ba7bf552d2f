"""The API document, made to tell the truth: FastAPI's schema plus what only the config knows —
the backend names, the caps on nframes, max_pixels, inline frames and batch size, and the
backend_kwargs a request may send (sampling fields with their bounds, score_mode, the seed's
prompt kwargs, the templates' variables). The test suite runs schemathesis against it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from proxy.answers.estimate import REDUCTIONS, single_token_values
from proxy.answers.preference import DEFAULT_COMPARE_PROMPT, PROMPT_NAME, parse_compare_template
from proxy.answers.scales import SCORE_MODES, scale_for_mode
from proxy.config import BackendConfig, SamplingConfig, Settings
from proxy.prompting.request import MAX_SAMPLES
from proxy.prompting.templates import SEED_PROMPT_KWARGS, PromptStore

__all__ = ["install_openapi"]


def _backend_kwargs_schema(settings: Settings, prompts: PromptStore) -> dict[str, Any]:
    sampling = SamplingConfig.model_json_schema()["properties"]
    properties: dict[str, Any] = {name: {k: v for k, v in spec.items() if k != "default"}
                                  for name, spec in sampling.items()}
    properties["max_tokens"]["maximum"] = _max_tokens(settings)
    properties["score_mode"] = {"enum": list(SCORE_MODES)}
    for key in SEED_PROMPT_KWARGS:
        properties[key] = {"type": "string", "maxLength": settings.proxy.max_prompt_chars}
    properties.update(  # proxy/answers/estimate.py; how they combine is checked per request (a 422 names the key)
        constrain={"type": "boolean"}, logprob_score={"type": "boolean"},
        samples={"type": "integer", "minimum": 1, "maximum": MAX_SAMPLES},
        quorum={"type": "integer", "minimum": 1, "maximum": MAX_SAMPLES}, reduce={"enum": list(REDUCTIONS)})
    for backend in _chat(settings).values():
        template = prompts.get(backend.prompt)
        for variable in template.variable_names - {"task_text"}:
            properties[variable] = {"type": "string"}
        if template.answer.per_frame:  # GVL: the shown order's seed (proxy/prompting/request.py)
            properties["shuffle_seed"] = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "not": {"required": ["user_prompt", "prompt_template"]},  # each replaces the whole user text
            "anyOf": _estimate_combinations(),
            "description": "sampling overrides within bounds, score_mode, the estimate (constrain, samples, "
                           "reduce, quorum, logprob_score), the seed's system_prompt / user_prompt / "
                           "prompt_template, and the prompt template's variables"}


def _chat(settings: Settings) -> dict[str, BackendConfig]:
    """The backends /score, /score/dense and /compare take (embedding ones serve /progress)."""
    return {name: b for name, b in settings.backends.items() if b.kind == "chat"}


def _max_tokens(settings: Settings) -> int:
    return min((b.max_tokens_limit for b in _chat(settings).values()), default=BackendConfig.model_fields[
        "max_tokens_limit"].default)


def _labels(backends: Iterable[tuple[str, BackendConfig]]) -> list[str]:
    """Every name a request may pick these backends by."""
    return sorted({label for name, b in backends for label in (name, b.model, *b.aliases)})


def _estimate_combinations() -> list[dict[str, Any]]:
    """How the estimate's keys combine (proxy/prompting/request.py checks the same per request): quorum ≤ samples;
    k > 1 samples need a temperature above 0 and exclude logprob_score. Stated with the temperature
    in the request, the rule that holds whatever the backend's default temperature."""
    one = {"properties": {"samples": {"const": 1}, "quorum": {"maximum": 1}}}
    many = [{"required": ["samples", "temperature"],
             "properties": {"samples": {"const": k}, "quorum": {"maximum": k},
                            "temperature": {"exclusiveMinimum": 0}, "logprob_score": {"const": False}}}
            for k in range(2, MAX_SAMPLES + 1)]
    return [one, *many]


def _logprob_scale_rule(settings: Settings, prompts: PromptStore) -> dict[str, Any] | None:
    """logprob_score needs an answer of one token: per backend, the score_modes that give one
    (proxy/prompting/request.py checks the same per request); None when every combination does."""
    off = {"properties": {"backend_kwargs": {"properties": {"logprob_score": {"const": False}}}}}
    branches, everywhere = [off], True
    for index, (name, backend) in enumerate(_chat(settings).items()):
        declared = prompts.get(backend.prompt).answer
        modes = [m for m in SCORE_MODES
                 if single_token_values(replace(declared, scale=scale_for_mode(m, declared.scale))) is not None]
        by_default = backend.score_mode in modes
        everywhere &= len(modes) == len(SCORE_MODES)
        if not modes:
            continue
        kwargs: dict[str, Any] = {"properties": {"score_mode": {"enum": modes}}}
        if not by_default:
            kwargs["required"] = ["score_mode"]
        branch: dict[str, Any] = {"properties": {"backend": {"enum": _labels([(name, backend)])},
                                                 "backend_kwargs": kwargs}}
        if index == 0:  # no backend (or null) is the first one
            branch["properties"]["backend"]["enum"].append(None)
        else:
            branch["required"] = ["backend"]
        branches.append(branch)
    return None if everywhere else {"anyOf": branches}


def _document(app: FastAPI, settings: Settings, prompts: PromptStore) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="Score robot episodes with VLMs served by stock `vllm serve`.")
    schemas = document["components"]["schemas"]
    proxy = settings.proxy
    labels = _labels(_chat(settings).items())
    for name in ("ScoreRequest", "DenseRequest"):  # a dense request is a score request with points
        score = schemas[name]["properties"]
        score["backend"] = {"anyOf": [{"enum": labels}, {"type": "null"}], "default": None,
                            "description": "a backend's name, served model name or alias; null = the first"}
        score["nframes"]["anyOf"][0]["maximum"] = proxy.nframes_limit
        score["max_pixels"]["anyOf"][0]["maximum"] = proxy.max_pixels_limit
        score["frames"]["anyOf"][0]["maxItems"] = proxy.max_inline_frames
        score["backend_kwargs"] = _backend_kwargs_schema(settings, prompts)
        if (rule := _logprob_scale_rule(settings, prompts)) is not None:
            schemas[name].setdefault("allOf", []).append(rule)
    dense = schemas["DenseRequest"]["properties"]
    dense["points"]["anyOf"][0]["maximum"] = proxy.max_batch_items
    dense["prefix_ends"]["anyOf"][0]["maxItems"] = proxy.max_batch_items
    dense["prefix_ends"]["anyOf"][0]["uniqueItems"] = True
    if "ViewSource" in schemas:  # extra_view: the same inline-frame cap as the main view
        schemas["ViewSource"]["properties"]["frames"]["anyOf"][0]["maxItems"] = proxy.max_inline_frames
    schemas["BatchScoreRequest"]["properties"]["items"]["maxItems"] = proxy.max_batch_items
    _each_item_on_its_own(schemas["BatchScoreRequest"], "ScoreRequest")
    schemas["EndpointChange"]["properties"]["backend"] = {  # POST /admin/endpoints: any kind
        "enum": _labels(settings.backends.items()), "description": "a backend's name, served model name or alias"}
    _complete_progress(schemas, settings)
    _complete_compare(schemas, settings, prompts, labels)
    _state_what_the_schema_cannot(document)
    return document


def _each_item_on_its_own(batch: dict[str, Any], item: str) -> None:
    """A batch validates each item on its own (proxy/pipelines/batch.py): an object that is not a valid `item` gets
    its own 422 inside a 200, so the document accepts any object there and says so."""
    batch["properties"]["items"]["items"] = {
        "type": "object", "anyOf": [{"$ref": f"#/components/schemas/{item}"}, {"type": "object"}],
        "description": f"a {item}, validated on its own: an item that is not one gets its own 422 in "
                       "`results` (ok: false) and the batch still answers 200 (one broken item never "
                       "sinks the batch)"}


# What a 422 may also mean where a request carries media or frame indices: what only the content tells.
_CONTENT_422 = ("; also content the schema cannot check: a frame that is not a PNG or JPEG image, a video "
                "that cannot be decoded, a frame index past the episode's last frame, a prompt over the "
                "model's context (max_model_len)")
_BATCH_200 = ("every item's own result or error, in request order: an item the schema or its content "
              "refuses gets its own status (422, 403, 404, ...) inside this 200")


def _state_what_the_schema_cannot(document: dict[str, Any]) -> None:
    for path, methods in document["paths"].items():
        for operation in methods.values():
            responses = operation.get("responses", {})
            if "422" in responses and path.startswith(("/score", "/compare", "/progress")):
                responses["422"]["description"] += _CONTENT_422
            if path in ("/score/batch", "/compare/batch") and "200" in responses:
                responses["200"]["description"] = _BATCH_200


def _complete_progress(schemas: dict[str, Any], settings: Settings) -> None:
    """/progress/*: embedding backends only; an item is a /score request that names no other backend
    and takes no backend_kwargs, and in a batch says its task and whether the simulator saw a success."""
    embedding = _labels((n, b) for n, b in settings.backends.items() if b.kind == "embedding")
    item = {"properties": {"backend": {"type": "null"}, "backend_kwargs": {"maxProperties": 0}}}
    labelled = {"required": ["metadata"], "properties": {"metadata": {
        "type": "object", "required": ["task_id", "env_success"],
        "properties": {"task_id": {"not": {"type": "null"}}, "env_success": {"type": "boolean"}}}}}
    for name, rules in (("ProgressBatchRequest", [item, labelled]), ("ReferencesRequest", [item])):
        properties = schemas[name]["properties"]
        properties["backend"] = {
            "anyOf": [{"enum": embedding}, {"type": "null"}], "default": None,
            "description": "an embedding backend's name, served model name or alias; null = the first"}
        properties["items"]["maxItems"] = settings.proxy.max_batch_items
        properties["items"]["items"] = {"allOf": [{"$ref": "#/components/schemas/ScoreRequest"}, *rules]}


def _complete_compare(schemas: dict[str, Any], settings: Settings, prompts: PromptStore, labels: list[str]) -> None:
    """POST /compare: the same caps as /score, the comparison templates, and their backend_kwargs
    (sampling fields and the templates' variables; nothing of the score's estimate)."""
    proxy, compare = settings.proxy, schemas["CompareRequest"]["properties"]
    compare["backend"] = {"anyOf": [{"enum": labels}, {"type": "null"}], "default": None,
                          "description": "a backend's name, served model name or alias; null = the first"}
    compare["nframes"]["anyOf"][0]["maximum"] = proxy.nframes_limit
    compare["max_pixels"]["anyOf"][0]["maximum"] = proxy.max_pixels_limit
    schemas["CompareEpisode"]["properties"]["frames"]["anyOf"][0]["maxItems"] = proxy.max_inline_frames
    store = PromptStore(prompts.directory, parser=parse_compare_template)
    names = sorted(p.stem for p in prompts.directory.glob("compare_*.yaml") if PROMPT_NAME.match(p.stem))
    compare["prompt"] = {"anyOf": [{"enum": names}, {"type": "null"}], "default": None,
                         "description": f"a comparison template of prompts_dir; null = {DEFAULT_COMPARE_PROMPT}"}
    sampling = SamplingConfig.model_json_schema()["properties"]
    kwargs: dict[str, Any] = {name: {k: v for k, v in spec.items() if k != "default"}
                              for name, spec in sampling.items()}
    kwargs["max_tokens"]["maximum"] = _max_tokens(settings)
    for name in names:
        kwargs.update({v: {"type": "string"} for v in store.get(name).variable_names - {"task_text"}})
    compare["backend_kwargs"] = {"type": "object", "properties": kwargs, "additionalProperties": False,
                                 "description": "sampling overrides within bounds, and the comparison "
                                                "template's variables"}
    schemas["BatchCompareRequest"]["properties"]["items"]["maxItems"] = proxy.max_batch_items
    _each_item_on_its_own(schemas["BatchCompareRequest"], "CompareRequest")


def install_openapi(app: FastAPI, settings: Settings, prompts: PromptStore) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, settings, prompts)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
