"""The API document, made to tell the truth: FastAPI's schema plus what only the config knows —
the backend names, the caps on nframes, max_pixels, inline frames and batch size, and the
backend_kwargs a request may send (sampling fields with their bounds, score_mode, the seed's
prompt kwargs, the templates' variables). The test suite runs schemathesis against it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from proxy.config import SamplingConfig, Settings
from proxy.prompts import SEED_PROMPT_KWARGS, PromptStore
from proxy.scales import SCORE_MODES

__all__ = ["install_openapi"]


def _backend_kwargs_schema(settings: Settings, prompts: PromptStore) -> dict[str, Any]:
    sampling = SamplingConfig.model_json_schema()["properties"]
    properties: dict[str, Any] = {name: {k: v for k, v in spec.items() if k != "default"}
                                  for name, spec in sampling.items()}
    properties["max_tokens"]["maximum"] = min(b.max_tokens_limit for b in settings.backends.values())
    properties["score_mode"] = {"enum": list(SCORE_MODES)}
    for key in SEED_PROMPT_KWARGS:
        properties[key] = {"type": "string", "maxLength": settings.proxy.max_prompt_chars}
    for backend in settings.backends.values():
        for variable in prompts.get(backend.prompt).variable_names - {"task_text"}:
            properties[variable] = {"type": "string"}
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "not": {"required": ["user_prompt", "prompt_template"]},  # each replaces the whole user text
            "description": "sampling overrides within bounds, score_mode, the seed's system_prompt / "
                           "user_prompt / prompt_template, and the prompt template's variables"}


def _document(app: FastAPI, settings: Settings, prompts: PromptStore) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="Score robot episodes with VLMs served by stock `vllm serve`.")
    schemas = document["components"]["schemas"]
    score = schemas["ScoreRequest"]["properties"]
    proxy = settings.proxy
    labels = sorted({label for name, b in settings.backends.items() for label in (name, b.model, *b.aliases)})
    score["backend"] = {"anyOf": [{"enum": labels}, {"type": "null"}], "default": None,
                        "description": "a backend's name, served model name or alias; null = the first"}
    score["nframes"]["anyOf"][0]["maximum"] = proxy.max_nframes
    score["max_pixels"]["anyOf"][0]["maximum"] = proxy.max_pixels_limit
    score["frames"]["anyOf"][0]["maxItems"] = proxy.max_inline_frames
    score["backend_kwargs"] = _backend_kwargs_schema(settings, prompts)
    schemas["BatchScoreRequest"]["properties"]["items"]["maxItems"] = proxy.max_batch_items
    return document


def install_openapi(app: FastAPI, settings: Settings, prompts: PromptStore) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, settings, prompts)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
