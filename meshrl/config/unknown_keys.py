"""What the error for an unknown config key says besides "unknown config key".

A verl key that meshrl has under another name, or does not need, gets what to do instead
(verl_keys.py); any other key gets the closest key of its section ("did you mean ..."), or
the places where a key of that name lives when it was put in the wrong section.
"""

from __future__ import annotations

import difflib
from functools import cache
from typing import Any, TypeGuard, get_args, get_origin

from pydantic import BaseModel

from meshrl.config.schema import RunConfig
from meshrl.config.verl_keys import VERL_KEYS, verl_key

# A name found in more places than this (`enable`, `path`) says nothing about which was meant.
_MAX_PLACES = 3


def unknown_key_lines(loc: tuple[str | int, ...], given: Any) -> list[str]:
    """The error lines for the unknown key at ``loc`` (pydantic's location) holding ``given``."""
    key = ".".join(str(part) for part in loc)
    if verl_key(key) is None:
        return [f"{key}: unknown config key{_did_you_mean(loc)}"]
    # A verl section given as a whole (`reward_model: {enable: true, model: {path: ...}}`) is
    # one unknown key to pydantic; its settings may each have their own meshrl key. Each
    # line names the settings given (`fsdp_config.grad_offload`, not just `fsdp_config`:
    # its neighbours may have been accepted), once for the entry that answers for them.
    leaves_of: dict[str, list[str]] = {}
    for leaf in _leaves(key, given):
        entry = verl_key(leaf)
        assert entry is not None  # key, above every leaf, has an entry
        leaves_of.setdefault(entry[0], []).append(leaf)
    return [
        f"{', '.join(leaves)}: {VERL_KEYS[entry_key].hint()}"
        for entry_key, leaves in leaves_of.items()
    ]


def _leaves(key: str, given: Any) -> list[str]:
    """The dotted keys of the settings under ``key``: itself unless it holds a mapping."""
    if not isinstance(given, dict) or not given:
        return [key]
    return [leaf for name, value in given.items() for leaf in _leaves(f"{key}.{name}", value)]


def _did_you_mean(loc: tuple[str | int, ...]) -> str:
    *parent, name = (str(part) for part in loc)
    section = _section_at(parent)
    if section is None:
        return ""
    close = difflib.get_close_matches(name, list(section.model_fields), n=1)
    if close:
        return f"; did you mean {'.'.join([*parent, close[0]])}?"
    places = [key for key in _schema_keys() if key.rsplit(".", 1)[-1] == name]
    if 0 < len(places) <= _MAX_PLACES:
        return f"; did you mean {' or '.join(places)}?"
    return ""


def _section_at(path: list[str]) -> type[BaseModel] | None:
    """The schema section that ``path`` names (RunConfig for []), or None if none."""
    section: type[BaseModel] = RunConfig
    parts = iter(path)
    for part in parts:
        field = section.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        if get_origin(annotation) is dict:  # a mapping of sections: the next part is its key
            if next(parts, None) is None:
                return None
            annotation = get_args(annotation)[1]
        if not _is_section(annotation):
            return None
        section = annotation
    return section


@cache
def _schema_keys() -> tuple[str, ...]:
    """Every dotted key of the schema, sections included (not below user-named mappings)."""

    def walk(section: type[BaseModel], prefix: str) -> list[str]:
        keys = []
        for name, field in section.model_fields.items():
            keys.append(prefix + name)
            if _is_section(field.annotation):
                keys += walk(field.annotation, f"{prefix}{name}.")
        return keys

    return tuple(walk(RunConfig, ""))


def _is_section(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
