"""Where the configuration comes from: defaults < YAML file < PICKER_* environment < flags.

Builds the one model of picker/config/model.py; every error names the field (and the variable or file it
came from). Nothing here exits the process (only `cli.py` does).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from picker.config.model import ConfigError, PickerConfig, SchedulingConfig
from picker.config.plugins import PluginConfig, PluginConfigError, parse_plugin_config

ENV_PREFIX = "PICKER_"
ENV_DELIMITER = "__"
# PICKER_* variables that are not settings (read by the CLI, the test tiers and the vLLM installer).
NOT_SETTINGS = frozenset({"PICKER_EVENT_LOOP", "PICKER_SKIP_REAL_VLLM", "PICKER_VLLM_PYTHON"})


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"config file {path}: nested too deeply to read") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def _setting_names(model: type[BaseModel], prefix: str = ENV_PREFIX) -> list[str]:
    names = []
    for name, info in model.model_fields.items():
        var = prefix + name.upper()
        names.append(var)
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            names.extend(_setting_names(info.annotation, var + ENV_DELIMITER))
    return names


def _takes_json(annotation: Any) -> bool:
    """Lists and groups may be given as JSON in the environment; scalars are taken as written."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return getattr(annotation, "__origin__", None) in (tuple, list, dict)


def _env_value(annotation: Any, raw: str) -> Any:
    if _takes_json(annotation) and raw.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(raw)
        except ValueError:
            pass  # not JSON: e.g. "[fd00::1]:8000,[fd00::2]:8000", which the field's own parsing splits
    return raw


def read_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """The PICKER_* settings as nested dicts, and which variable set each field.

    A variable that names no setting is an error naming it (top-level and nested alike), never
    silently ignored. Names are matched case-insensitively; lists take the same forms as their flags
    (`a:8000,b:8000`) or a JSON list.
    """
    values: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}
    # Whole groups (PICKER_POOL='{...}') first, so PICKER_POOL__ENDPOINTS can refine them.
    for var in sorted(environ, key=lambda v: v.count(ENV_DELIMITER)):
        if not var.upper().startswith(ENV_PREFIX) or var.upper() in NOT_SETTINGS:
            continue
        path = tuple(var[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER))
        model: type[BaseModel] | None = PickerConfig
        annotation: Any = None
        for depth, key in enumerate(path):
            info = model.model_fields.get(key) if model is not None else None
            if info is None:
                close = difflib.get_close_matches(var.upper(), _setting_names(PickerConfig), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"environment variable {var}: no such setting{hint}")
            annotation = info.annotation
            is_group = isinstance(annotation, type) and issubclass(annotation, BaseModel)
            model = annotation if is_group and depth < len(path) - 1 else None
        node = values
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {var}: {key} is set as a whole by another variable")
            node = child
        node[path[-1]] = _env_value(annotation, environ[var])
        origin[path] = var
    return values, origin


def merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`, group by group (a group given in both keeps the fields of each)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _describe(exc: ValidationError, origin: Mapping[tuple[str, ...], str] | None = None) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        field = ".".join(loc) or "(top level)"
        source = next((origin[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in (origin or {})), None)
        lines.append(f"{field} (from {source}): {err['msg']}" if source else f"{field}: {err['msg']}")
    return "invalid configuration: " + "; ".join(lines)


def load_config(
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> PickerConfig:
    """Merge defaults < file < PICKER_* environment < flags (``overrides``, nested dicts)."""
    file_data = _read_yaml(path) if path is not None else {}
    env_data, origin = read_env(os.environ if environ is None else environ)
    flags = overrides or {}
    # A field the flags set is no longer the environment's: do not blame a variable for it.
    origin = {loc: var for loc, var in origin.items() if _lookup(flags, loc) is None}
    try:
        return PickerConfig.model_validate(merge(merge(file_data, env_data), flags))
    except ValidationError as exc:
        raise ConfigError(_describe(exc, origin)) from exc


def _lookup(data: Mapping[str, Any], loc: tuple[str, ...]) -> Any:
    node: Any = data
    for key in loc:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def read_plugin_config(scheduling: SchedulingConfig) -> PluginConfig | None:
    """The reference picker's EndpointPickerConfig named by `scheduling.config_file` / `config_text`,
    parsed; None when neither is set. ConfigError naming the file (or the plugin) when unusable."""
    if scheduling.config_file is not None:
        try:
            text, source = scheduling.config_file.read_text(encoding="utf-8"), str(scheduling.config_file)
        except OSError as exc:
            raise ConfigError(f"scheduling.config_file {scheduling.config_file}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"scheduling.config_file {scheduling.config_file}: not UTF-8 (byte {exc.start})"
            ) from None
    elif scheduling.config_text is not None:
        text, source = scheduling.config_text, "scheduling.config_text"
    else:
        return None
    try:
        return parse_plugin_config(text, source)
    except PluginConfigError as exc:
        raise ConfigError(str(exc)) from exc
