"""One-line messages for what LightningCLI's parser rejects: what was wrong, where, and the closest valid name.

jsonargparse answers a mistake with its whole usage (50-60 lines) and, for a key in a YAML file, neither
names the file nor suggests anything. :func:`explain_parse_error` turns its message into one line.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["class_parameters", "closest", "explain_parse_error", "option_names", "where"]

#: options every LightningCLI parser has that are never what a typo meant
_NOT_SUGGESTED = {"help", "config", "print_config"}


def closest(name: str, candidates: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the closest candidate (:mod:`difflib`), or ``""`` when none is close."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def option_names(parser: Any) -> list[str]:
    """Dotted option names (``trainer.max_steps``, ``model``, ...) of a jsonargparse parser."""
    names = (s[2:] for action in parser._actions for s in action.option_strings if s.startswith("--"))
    return [n for n in names if n not in _NOT_SUGGESTED and not n.endswith(".help")]


def class_parameters(class_path: str) -> list[str]:
    """Init arguments of ``class_path``, following ``**kwargs`` up the MRO as jsonargparse does."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    found: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]  # without self
        found += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(found))


def where(key: str, argv: Sequence[str], config: Path | None) -> str:
    """Where ``key`` (dotted) was given: ``on the command line`` or ``in <config>, line N``."""
    for arg in argv:
        if arg.startswith("--") and arg[2:].split("=", 1)[0] == key:
            return "on the command line"
    if config is not None and config.is_file():
        leaf = re.compile(rf"^\s*{re.escape(key.rsplit('.', 1)[-1])}\s*:")
        for number, line in enumerate(config.read_text().splitlines(), 1):
            if leaf.match(line):
                return f"in {config}, line {number}"
        return f"in {config} or on the command line"
    return "on the command line"


def explain_parse_error(message: str, parser: Any, argv: Sequence[str], config: Path | None) -> str:
    """One line for jsonargparse's error ``message`` raised by ``parser`` (the subcommand's) on ``argv``."""
    valid = option_names(parser)
    unknown = re.search(r"does not accept option '([^']+)'", message) or re.search(
        r"unrecognized arguments: --([^\s=]+)", message
    )
    if unknown:
        key = unknown.group(1)
        return f"unknown option {key!r} {where(key, argv, config)}{closest(key, valid)}"
    groups = re.findall(r'Parser key "([^"]+)"', message)
    bad_init = re.search(r"class_path '([^']+)':\s*Option '([^']+)' is not accepted", message)
    if bad_init and groups:
        key = f"{groups[0]}.{bad_init.group(2)}"
        candidates = [f"{groups[0]}.{p}" for p in class_parameters(bad_init.group(1))]
        hint = closest(key, candidates) or f"; {bad_init.group(1)} takes {', '.join(candidates) or 'nothing'}"
        return f"unknown option {key!r} {where(key, argv, config)}{hint}"
    expected = re.search(r"^\s*(Expected .*)$", message, re.MULTILINE)
    if groups and expected:
        key = ".".join(groups)
        return f"bad value for {key!r} {where(key, argv, config)}: {expected.group(1)}"
    return " ".join(line.strip() for line in message.splitlines() if line.strip())
