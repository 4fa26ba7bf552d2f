"""Reading a config file into the one model: strict YAML, the file's relative paths, a run's choice
of backends (`--only`) and endpoints placed at run time (`up --ray`), and errors that name the
dotted path of a bad key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from proxy.config.settings import Settings
from proxy.errors import ConfigError
from vlm_protocol import strict_yaml

__all__ = ["load_settings", "only_backends", "read_config", "settings_from_dict"]


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"  {key}: {item['msg']}")
    return "\n".join(lines)


def settings_from_dict(data: dict, *, base_dir: Path | None = None, source: str = "<dict>") -> Settings:
    try:
        settings = Settings.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from err
    if base_dir is not None:
        settings = _resolve_paths(settings, base_dir)
    return settings


def _resolve_paths(settings: Settings, base_dir: Path) -> Settings:
    """Relative paths in a config file are relative to that file, not to the working dir."""

    def resolve(p: Path) -> Path:
        return p if p.is_absolute() else (base_dir / p).resolve()

    store, references = settings.proxy.frame_store, settings.proxy.reference_store
    proxy = settings.proxy.model_copy(
        update={
            "prompts_dir": resolve(settings.proxy.prompts_dir),
            "allowed_media_roots": [resolve(r) for r in settings.proxy.allowed_media_roots],
            "audit_log": resolve(settings.proxy.audit_log) if settings.proxy.audit_log else None,
            "frame_store": store.model_copy(update={"dir": resolve(store.dir)}) if store else None,
            "reference_store": (references.model_copy(update={"dir": resolve(references.dir)})
                                if references else None),
        }
    )
    # A launch model_path may be a Hugging Face repo id ("Qwen/..."), so only a path written as
    # relative ("./x", "../x") is taken from this file's directory.
    backends = {
        name: backend.model_copy(update={"launch": backend.launch.model_copy(
            update={"model_path": str(resolve(Path(backend.launch.model_path)))})})
        if backend.launch and backend.launch.model_path.startswith(("./", "../")) else backend
        for name, backend in settings.backends.items()}
    return settings.model_copy(update={"proxy": proxy, "backends": backends})


def load_settings(path: str | Path, endpoints: Mapping[str, list[str]] | None = None,
                  only: Sequence[str] | None = None) -> Settings:
    """The config file, validated; `endpoints` replaces named backends' endpoint lists (`up --ray`
    knows them only once Ray has placed the replicas); `only` keeps just those backends (names or
    aliases), so one config serves a run that needs one model without starting the others."""
    path = Path(path)
    data = read_config(path)
    if only:
        data["backends"] = only_backends(data.get("backends"), only, path)
        data["cascades"] = _cascades_of(data.get("cascades"), data["backends"])
    if endpoints is not None and not (isinstance(endpoints, dict) and all(
            isinstance(u, list) and all(isinstance(x, str) for x in u) for u in endpoints.values())):
        raise ConfigError("endpoints must map backend names to lists of URLs, e.g. {\"qwen\": [\"http://h:8001/v1\"]}")
    for name, urls in (endpoints or {}).items():
        backend = (data.get("backends") or {}).get(name)
        if not isinstance(backend, dict):
            raise ConfigError(f"endpoints given for backend {name!r}, which config {path} does not define")
        backend["endpoints"] = list(urls)
    return settings_from_dict(data, base_dir=path.parent.resolve(), source=str(path))


def only_backends(backends: Any, only: Sequence[str], path: Path) -> dict:
    """The named backends of a config's `backends` mapping, in the config's order."""
    backends = backends if isinstance(backends, dict) else {}
    keep = set()
    for wanted in only:
        name = next((n for n, cfg in backends.items()
                     if wanted == n or (isinstance(cfg, dict) and wanted in (cfg.get("aliases") or []))), None)
        if name is None:
            raise ConfigError(f"backend {wanted!r} is not in config {path} (backends: {', '.join(backends)})")
        keep.add(name)
    return {name: cfg for name, cfg in backends.items() if name in keep}


def _cascades_of(cascades: Any, backends: dict) -> dict:
    """The cascades whose every stage is among `backends` (names or aliases): the others need a
    backend this run does not start."""
    if not isinstance(cascades, dict):
        return {}
    labels = {label for name, cfg in backends.items()
              for label in (name, *((cfg.get("aliases") or []) if isinstance(cfg, dict) else []))}
    return {name: cascade for name, cascade in cascades.items()
            if isinstance(cascade, dict) and all(isinstance(stage, dict) and stage.get("backend") in labels
                                                 for stage in cascade.get("stages") or [])}


def read_config(path: Path) -> dict:
    """The config file as a plain mapping (strict YAML), before validation: for tools that change
    a setting or two and then validate the whole (`replay`)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from err
    try:
        data = strict_yaml.load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping with 'proxy' and 'backends'")
    return data
