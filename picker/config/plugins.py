"""The reference picker's plugin configuration (`EndpointPickerConfig`), as `--config-file` / `--config-text`.

Its Helm chart mounts one (`default-plugins.yaml`) and passes `--config-file /config/<file>`, so a
user swapping the image keeps it. Read here, once, at start: `apiVersion` `llm-d.ai/v1alpha1` (or the
older `inference.networking.x-k8s.io/v1alpha1`), `kind: EndpointPickerConfig`, `plugins` (each a
`type`, an optional `name`, optional `parameters`) and `schedulingProfiles` (each a `name` and
`plugins`: `pluginRef` with an optional `weight`, default 1, as the reference's).

A plugin type this picker does not know is a start-up error naming it; a known one that this
version does not apply yet is named in one log line. Pure: parses text, no file I/O (the caller
reads the file), no network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

API_VERSIONS = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
KIND = "EndpointPickerConfig"
DEFAULT_WEIGHT = 1.0

# What this picker's scheduling does, by the reference's plugin type (docs, "Cache-aware routing").
APPLIED: Mapping[str, str] = {
    "queue-scorer": "affinity.load_weight (with the KV-cache scorer's weight)",
    "kv-cache-utilization-scorer": "affinity.load_weight (with the queue scorer's weight)",
    "max-score-picker": "the best-scored endpoint is the primary, the next ones are fallbacks",
    "single-profile-handler": "one scheduling profile",
    "metrics-data-source": "the /metrics scraper",
    "core-metrics-extractor": "the /metrics scraper's vLLM gauges",
    "prefix-cache-scorer": "affinity.prefix approximate, affinity.prefix_weight",
    "approx-prefix-cache-producer": "affinity.prefix approximate (block size, blocks, index size)",
    "precise-prefix-cache-producer": "affinity.prefix precise (the engines' KV events)",
    "precise-prefix-cache-scorer": "affinity.prefix precise, affinity.prefix_weight",
    "prefix-cache-affinity-filter": "affinity.sticky_threshold (its affinityThreshold)",
    "lora-affinity-scorer": "affinity.lora_weight",
    "session-affinity-scorer": "affinity.session_header (the session_id mode)",
    "token-producer": "precise: token ids from the engines' /tokenize",
    "latency-scorer": "affinity.latency, affinity.latency_weight (learned in the picker, no sidecar)",
    "predicted-latency-producer": "affinity.latency (each replica's TTFT and TPOT learned online)",
    "latency-slo-admitter": "the SLO headers: a sheddable request no replica can serve in time is refused",
    "slo-headroom-tier-filter": "the SLO headers: the replicas predicted to meet them are preferred",
}
# Types this picker knows and will apply, not yet in this version: named in a log line at start.
NOT_YET: Mapping[str, str] = {
    "token-load-scorer": "in-flight token load (the load score counts requests)",
}


class PluginConfigError(ValueError):
    """The configuration cannot be used (the message names the field or plugin)."""


@dataclass(frozen=True, slots=True)
class Plugin:
    type: str
    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    weights: tuple[tuple[str, float], ...]  # (plugin name, weight), in the file's order


@dataclass(frozen=True, slots=True)
class PluginConfig:
    plugins: tuple[Plugin, ...]
    profiles: tuple[Profile, ...]
    notes: tuple[str, ...] = ()  # one log line each, at start

    def weight(self, plugin_type: str, profile: str | None = None) -> float | None:
        """The weight the (first, or named) profile gives a plugin of this type; None: not in it."""
        names = {p.name for p in self.plugins if p.type == plugin_type}
        chosen = next((p for p in self.profiles if profile is None or p.name == profile), None)
        if chosen is None:
            return None
        return next((w for name, w in chosen.weights if name in names), None)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PluginConfigError(f"{where}: expected a mapping")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PluginConfigError(f"{where}: expected a list")
    return value


def parse_plugin_config(text: str, source: str = "--config-text") -> PluginConfig:
    """Read an EndpointPickerConfig; PluginConfigError naming `source` and the field when it cannot."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PluginConfigError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise PluginConfigError(f"{source}: nested too deeply to read") from None
    document = _mapping(data or {}, source)
    notes: list[str] = []
    version = document.get("apiVersion")
    if version not in API_VERSIONS:
        raise PluginConfigError(
            f"{source}: apiVersion {version!r}: expected one of {', '.join(API_VERSIONS)}"
        )
    if version != API_VERSIONS[0]:
        notes.append(f"{source}: apiVersion {version} is deprecated; {API_VERSIONS[0]} is current")
    if document.get("kind") != KIND:
        raise PluginConfigError(f"{source}: kind {document.get('kind')!r}: expected {KIND}")
    for key in document:
        if key not in ("apiVersion", "kind", "plugins", "schedulingProfiles"):
            notes.append(f"{source}: {key}: not read by this picker (its own settings cover it)")
    plugins: list[Plugin] = []
    for index, raw in enumerate(_list(document.get("plugins"), f"{source}: plugins")):
        entry = _mapping(raw, f"{source}: plugins[{index}]")
        plugin_type = entry.get("type")
        if not isinstance(plugin_type, str) or not plugin_type:
            raise PluginConfigError(f"{source}: plugins[{index}]: missing type")
        if plugin_type not in APPLIED and plugin_type not in NOT_YET:
            known = ", ".join(sorted({*APPLIED, *NOT_YET}))
            raise PluginConfigError(
                f"{source}: plugins[{index}]: plugin type {plugin_type!r} is not implemented by this "
                f"picker (it implements: {known})"
            )
        name = entry.get("name", plugin_type)
        if not isinstance(name, str) or not name:
            raise PluginConfigError(f"{source}: plugins[{index}]: name must be a string")
        parameters = _mapping(entry.get("parameters") or {}, f"{source}: plugins[{index}].parameters")
        plugins.append(Plugin(plugin_type, name, dict(parameters)))
        if plugin_type in NOT_YET:
            notes.append(f"{source}: {plugin_type}: {NOT_YET[plugin_type]} is not in this version; ignored")
    names = {p.name for p in plugins}
    if len(names) != len(plugins):
        raise PluginConfigError(f"{source}: plugins: two plugins share a name")
    profiles: list[Profile] = []
    for index, raw in enumerate(_list(document.get("schedulingProfiles"), f"{source}: schedulingProfiles")):
        entry = _mapping(raw, f"{source}: schedulingProfiles[{index}]")
        profile_name = entry.get("name")
        if not isinstance(profile_name, str) or not profile_name:
            raise PluginConfigError(f"{source}: schedulingProfiles[{index}]: missing name")
        weights = []
        for ref_index, ref_raw in enumerate(_list(entry.get("plugins"), f"{source}: {profile_name}.plugins")):
            ref = _mapping(ref_raw, f"{source}: {profile_name}.plugins[{ref_index}]")
            ref_name = ref.get("pluginRef")
            if ref_name not in names:
                raise PluginConfigError(
                    f"{source}: {profile_name}.plugins[{ref_index}]: pluginRef {ref_name!r} names no plugin"
                )
            weight = ref.get("weight", DEFAULT_WEIGHT)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
                raise PluginConfigError(
                    f"{source}: {profile_name}.plugins[{ref_index}]: weight must be a number >= 0"
                )
            weights.append((str(ref_name), float(weight)))
        profiles.append(Profile(profile_name, tuple(weights)))
    if len(profiles) > 1:
        notes.append(
            f"{source}: {len(profiles)} scheduling profiles: only the first ({profiles[0].name}) is used"
        )
    return PluginConfig(tuple(plugins), tuple(profiles), tuple(notes))


def affinity_settings(config: PluginConfig) -> dict[str, Any]:
    """The `affinity` settings a plugin configuration implies (its first profile's weights)."""
    types = {plugin.type: plugin for plugin in config.plugins}
    out: dict[str, Any] = {}
    precise = "precise-prefix-cache-producer" in types or "precise-prefix-cache-scorer" in types
    approximate = "prefix-cache-scorer" in types or "approx-prefix-cache-producer" in types
    out["prefix"] = "precise" if precise else "approximate" if approximate else "off"
    scorer = (
        "precise-prefix-cache-scorer" if "precise-prefix-cache-scorer" in types else "prefix-cache-scorer"
    )
    prefix = config.weight(scorer)
    out["prefix_weight"] = (
        prefix if prefix is not None else (DEFAULT_WEIGHT if out["prefix"] != "off" else 0.0)
    )
    load = [
        w
        for w in (config.weight("queue-scorer"), config.weight("kv-cache-utilization-scorer"))
        if w is not None
    ]
    if load:
        out["load_weight"] = sum(load)
    lora = config.weight("lora-affinity-scorer")
    out["lora_weight"] = lora if lora is not None else 0.0
    affinity_filter = types.get("prefix-cache-affinity-filter")
    if affinity_filter is not None:
        threshold = affinity_filter.parameters.get("affinityThreshold", 0.8)
        if isinstance(threshold, int | float) and 0 <= threshold <= 1:
            out["sticky_threshold"] = float(threshold)
    else:
        out["sticky_threshold"] = 1.01  # no affinity filter: the weighted scores alone, as configured
    producer = types.get("approx-prefix-cache-producer") or types.get("prefix-cache-scorer")
    parameters = producer.parameters if producer is not None else {}
    block = parameters.get("blockSizeTokens", parameters.get("blockSize"))
    if isinstance(block, int) and block > 0:
        out["block_tokens"] = max(64, block)  # the reference clamps up to 64 too
    blocks = parameters.get("maxPrefixBlocksToMatch")
    if isinstance(blocks, int) and blocks > 0:
        out["max_blocks"] = blocks
    capacity = parameters.get("lruCapacityPerServer")
    if isinstance(capacity, int) and capacity >= 64:
        out["index_blocks"] = capacity
    latency = config.weight("latency-scorer")
    if latency is not None or "predicted-latency-producer" in types:
        out["latency"] = "on"
        if latency is not None:
            out["latency_weight"] = latency
    session = types.get("session-affinity-scorer")
    if session is not None:
        header = session.parameters.get("headerName", "x-session-id")
        out["session_header"] = header.lower() if isinstance(header, str) else "x-session-id"
    return out
