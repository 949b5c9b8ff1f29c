"""What the rules need to know about Kubernetes workloads: containers, flags, hooks, probes, selectors."""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from typing import Any

from picker.drain import wait as drain_wait
from picker.drain.manifests import Document, FieldPath, Unknown, get

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
POD_SPEC: FieldPath = ("spec", "template", "spec")
_SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash", "/usr/bin/bash", "/usr/bin/sh")
_SHELL_OPERATORS = (";", "&&", "||", "|", "&", "\n")
_ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_SLEEP_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(value: Any) -> float | None:
    """A plain number of seconds (int, float or numeric string), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _split_script(script: str) -> list[list[str]]:
    """A shell script as simple commands (split on ; && || | & and newlines)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.whitespace = " \t\r"
    commands: list[list[str]] = [[]]
    try:
        for token in lexer:
            if token in _SHELL_OPERATORS or set(token) <= set(";&|\n"):
                commands.append([])
            else:
                commands[-1].append(token)
    except ValueError:  # unbalanced quotes: keep the words we have
        pass
    return [command for command in commands if command]


def commands_of(argv: list[str]) -> list[list[str]]:
    """The simple commands an exec/command list runs: itself, or a `sh -c` script's commands."""
    if len(argv) >= 3 and argv[0] in _SHELLS and argv[1] in ("-c", "-ec", "-ce", "-xc"):
        return _split_script(argv[2])
    return [argv] if argv else []


@dataclass(frozen=True)
class Container:
    doc: Document
    path: FieldPath
    data: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.data.get("name", ""))

    @property
    def argv(self) -> list[str]:
        """command + args as words, shell scripts split into their words."""
        words: list[str] = []
        for key in ("command", "args"):
            values = self.data.get(key)
            if not isinstance(values, list):
                continue
            for value in values:
                text = str(value)
                if any(c.isspace() for c in text.strip()):
                    for command in _split_script(text):
                        words.extend(command)
                else:
                    words.append(text)
        return words

    @property
    def args_path(self) -> FieldPath:
        return (*self.path, "args" if "args" in self.data else "command")

    def env(self, name: str) -> str | None:
        for item in self.data.get("env") or []:
            if isinstance(item, dict) and item.get("name") == name and "value" in item:
                return str(item["value"])
        return None

    def flag(self, *names: str) -> str | Unknown | None:
        """The value given to a flag (`--f v` or `--f=v`), None when absent, Unknown when unresolvable."""
        words = self.argv
        for index, word in enumerate(words):
            for name in names:
                if word == name:
                    value = words[index + 1] if index + 1 < len(words) else ""
                elif word.startswith(name + "="):
                    value = word[len(name) + 1 :]
                else:
                    continue
                return self._expand(value)
        return None

    def has_flag(self, *names: str) -> bool:
        return any(w in names or any(w.startswith(n + "=") for n in names) for w in self.argv)

    def _expand(self, value: str) -> str | Unknown:
        """Kubernetes expands $(VAR) in args from the container's literal env values."""
        missing: list[str] = []

        def substitute(match: re.Match[str]) -> str:
            found = self.env(match.group(1))
            if found is None:
                missing.append(match.group(1))
                return ""
            return found

        expanded = _ENV_REF.sub(substitute, value)
        return Unknown(f"$({missing[0]}) is not a literal env value") if missing else expanded

    @property
    def image(self) -> str:
        return str(self.data.get("image", ""))

    @property
    def runs_vllm(self) -> bool:
        words = self.argv
        return (
            any(w == "vllm" or w.endswith("/vllm") or w.startswith("vllm.entrypoints") for w in words)
            or "vllm" in self.image.lower()
        )

    @property
    def runs_picker(self) -> bool:
        words = self.argv
        return "serve" in words and any(w == "picker" or w.endswith("/picker") for w in words)


@dataclass(frozen=True)
class Workload:
    doc: Document

    @property
    def pod_spec(self) -> dict[str, Any]:
        spec = get(self.doc.data, POD_SPEC)
        return spec if isinstance(spec, dict) else {}

    @property
    def replicas(self) -> int:
        value = get(self.doc.data, ("spec", "replicas"), 1)
        return value if isinstance(value, int) and not isinstance(value, bool) else 1

    @property
    def pod_labels(self) -> dict[str, str]:
        labels = get(self.doc.data, ("spec", "template", "metadata", "labels"), {})
        return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}

    @property
    def containers(self) -> list[Container]:
        items = self.pod_spec.get("containers")
        if not isinstance(items, list):
            return []
        return [
            Container(self.doc, (*POD_SPEC, "containers", i), item)
            for i, item in enumerate(items)
            if isinstance(item, dict)
        ]

    @property
    def grace_s(self) -> float:
        """terminationGracePeriodSeconds (Kubernetes default 30)."""
        value = seconds(self.pod_spec.get("terminationGracePeriodSeconds"))
        return 30.0 if value is None else value

    @property
    def grace_path(self) -> FieldPath:
        return (*POD_SPEC, "terminationGracePeriodSeconds")

    def vllm_containers(self) -> list[Container]:
        return [c for c in self.containers if c.runs_vllm]

    def picker_containers(self) -> list[Container]:
        return [c for c in self.containers if c.runs_picker]


def workloads(documents: list[Document]) -> list[Workload]:
    return [Workload(d) for d in documents if d.is_kubernetes and d.kind in WORKLOAD_KINDS]


def selector_matches(selector: Any, labels: dict[str, str], plain: bool = False) -> bool:
    """Does a LabelSelector (or a Service's plain map, `plain`) select pods with `labels`?"""
    if not isinstance(selector, dict):
        return False
    match_labels = selector if plain else selector.get("matchLabels") or {}
    if not isinstance(match_labels, dict):
        return False
    if any(labels.get(str(k)) != str(v) for k, v in match_labels.items()):
        return False
    for expression in [] if plain else selector.get("matchExpressions") or []:
        if not isinstance(expression, dict):
            return False
        key, operator = str(expression.get("key")), expression.get("operator")
        values = [str(v) for v in expression.get("values") or []]
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


@dataclass(frozen=True)
class PreStop:
    """What a preStop hook spends: `seconds` None when it cannot be known."""

    kind: str  # none | drain-wait | sleep | http | other
    seconds: float | None
    path: FieldPath
    detail: str = ""
    wait_settings: drain_wait.Settings | None = None
    wait_error: str | None = None


def _is_drain_wait(word: str) -> bool:
    return word in ("drain-wait", "picker.drain.wait") or word.endswith("wait.py")


def prestop_of(container: Container) -> PreStop:
    path = (*container.path, "lifecycle", "preStop")
    hook = get(container.data, ("lifecycle", "preStop"))
    if not isinstance(hook, dict):
        return PreStop("none", 0.0, path)
    if isinstance(hook.get("sleep"), dict):
        value = seconds(hook["sleep"].get("seconds"))
        return PreStop("sleep", value, (*path, "sleep", "seconds"), "sleep action")
    if "httpGet" in hook:
        return PreStop("http", None, (*path, "httpGet"), "an httpGet hook takes as long as its server")
    command = get(hook, ("exec", "command"))
    if not isinstance(command, list):
        return PreStop("other", None, path, "no exec command")
    exec_path = (*path, "exec", "command")
    total, known, settings, error = 0.0, False, None, None
    for words in commands_of([str(w) for w in command]):
        while words and (words[0] == "exec" or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
            words = words[1:]
        index = next((i for i, w in enumerate(words) if _is_drain_wait(w)), None)
        if index is not None:
            try:
                settings = drain_wait.parse_settings(words[index + 1 :])
            except drain_wait.UsageError as exc:
                error = str(exc)
                continue
            total, known = total + settings.deadline_s, True
        elif words and words[0].rsplit("/", 1)[-1] == "sleep" and len(words) > 1:
            match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", words[1])
            if match is None:
                return PreStop("other", None, exec_path, f"sleep {words[1]!r} not understood")
            total, known = total + float(match.group(1)) * _SLEEP_UNITS[match.group(2)], True
    if settings is not None or error is not None:
        return PreStop("drain-wait", total if known else None, exec_path, "", settings, error)
    if known:
        return PreStop("sleep", total, exec_path, "sleep command")
    return PreStop("other", None, exec_path, "an exec hook whose duration is not known")


def probe_budget(probe: dict[str, Any]) -> float:
    """Seconds before a probe can fail the container: initialDelay + period x failureThreshold."""
    delay = seconds(probe.get("initialDelaySeconds")) or 0.0
    period = seconds(probe.get("periodSeconds")) or 10.0
    failures = seconds(probe.get("failureThreshold")) or 3.0
    return delay + period * failures


def int_or_percent(value: Any, total: int, round_up: bool) -> int | None:
    """A rolling-update bound as a number of pods (percentages rounded as Kubernetes does)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\d+%", value):
        exact = total * int(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return None
