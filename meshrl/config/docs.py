"""docs/config.md, written from the schema: every key with its type, default and docstring.

    python -m meshrl.config.docs > docs/config.md      (or: make config-docs)

The schema (meshrl/config/schema.py, its sections in meshrl/config/sections/) is the one source:
each field's attribute docstring is its description (pydantic's ``use_attribute_docstrings``). tests/config/test_config_docs.py
fails when the checked-in page differs from what this writes.
"""

from __future__ import annotations

import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo

from meshrl.config.schema import RunConfig
from meshrl.config.sections.base import FileList, OneOrList, PathText

WIDTH = 95
COMMAND = "python -m meshrl.config.docs > docs/config.md"

_HEADER = f"""\
# Config reference

<!-- Written by `{COMMAND}` (make config-docs) from
meshrl/config/sections/: edit the sections' docstrings, not this page;
tests/config/test_config_docs.py checks that it is current. -->

Every key of a run config: its type, its default and what it does. A config is one YAML
file plus dotted `key=value` overrides on the command line (`meshrl run run.yaml
data.train_batch_size=64`); a key left out takes its default, and an unknown key is an
error that names the closest known one. `meshrl run run.yaml [key=value ...]
--print-config` prints the config a run would use, every default filled in. Keys follow
verl's names where they mean the same thing; docs/verl.md maps the others.
"""

# What the schema's Annotated types (PathText, OneOrList, FileList) add to a plain type, named by
# the function they run before validation.
_READ_AS = {
    get_args(PathText)[1].func: "path",
    get_args(OneOrList)[1].func: "{} (one value alone: a list of one)",
    get_args(FileList)[1].func: "{} (one value alone: a list of one; null: none)",
}
_BOUNDS = {
    annotated_types.Gt: ">",
    annotated_types.Ge: "≥",
    annotated_types.Lt: "<",
    annotated_types.Le: "≤",
}


def _is_model(annotation: object) -> typing.TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_name(annotation: Any) -> str:
    """How a key's type reads in the reference: ``list of path``, ``one of `a`, `b```,
    ``int or null``."""
    if get_origin(annotation) is Annotated:
        inner, *metadata = get_args(annotation)
        return _with_metadata(type_name(inner), metadata)
    if annotation is type(None):
        return "null"
    if get_origin(annotation) is Literal:
        *most, last = (f"`{_text(v)}`" for v in get_args(annotation))
        return f"{', '.join(most)} or {last}" if most else last
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(annotation))
    if get_origin(annotation) is list:
        return f"list of {type_name(get_args(annotation)[0])}"
    if get_origin(annotation) is dict:
        key, value = get_args(annotation)
        return f"mapping of {type_name(key)} to {type_name(value)}"
    if get_origin(annotation) is tuple:
        return "[" + ", ".join(type_name(a) for a in get_args(annotation)) + "]"
    if _is_model(annotation):
        return "section"
    return {str: "string", int: "int", float: "float", bool: "bool"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _with_metadata(name: str, metadata: list[Any]) -> str:
    for m in metadata:
        if isinstance(m, BeforeValidator) and m.func in _READ_AS:
            name = _READ_AS[m.func].format(name)
    return name


def _text(value: Any) -> str:
    """A value as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) + "}"
    if value == "":
        return '""'
    return str(value)


def _bounds(field: FieldInfo) -> str:
    return ", ".join(
        f"{sign} {_text(getattr(m, cls.__name__.lower()))}"
        for m in field.metadata
        for cls, sign in _BOUNDS.items()
        if isinstance(m, cls)
    )


def _prose(text: str | None) -> str:
    """A docstring as one paragraph (its line breaks were the source's wrapping)."""
    return " ".join((text or "").split())


def _wrapped(text: str, first: str = "", rest: str = "") -> str:
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _key_entry(key: str, field: FieldInfo) -> str:
    # pydantic keeps a field's own Annotated metadata (PathText's, a Field's bounds) apart
    kind = _with_metadata(type_name(field.annotation), field.metadata)
    bounds = _bounds(field)
    default = _text(field.get_default(call_default_factory=True))
    head = f"**`{key}`** ({kind}{', ' + bounds if bounds else ''}; default `{default}`):"
    return _wrapped(f"{head} {_prose(field.description)}", "- ", "  ")


def _sections(
    model: type[BaseModel], prefix: str, description: str | None
) -> Iterator[tuple[str, str, list[str]]]:
    """(dotted name, description, key entries) of ``model`` and of every section below it,
    depth first: a section's own keys before its subsections."""
    entries: list[str] = []
    below: list[tuple[type[BaseModel], str, str | None]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if _is_model(annotation):
            below.append((annotation, f"{key}.", field.description))
            continue
        entries.append(_key_entry(key, field))
        value = get_args(annotation)[1] if get_origin(annotation) is dict else None
        if _is_model(value):
            below.append((value, f"{key}.<name>.", field.description))
    own = " ".join(filter(None, [_prose(description), _prose(model.__doc__)]))
    yield prefix.rstrip("."), own, entries
    for inner, inner_prefix, inner_description in below:
        yield from _sections(inner, inner_prefix, inner_description)


def render() -> str:
    """The whole of docs/config.md."""
    parts = [_HEADER]
    for name, description, entries in _sections(RunConfig, "", None):
        if not name:  # RunConfig itself: only sections, no keys of its own
            continue
        level = "##" if "." not in name else "###"
        parts.append(f"{level} `{name}`\n")
        if description:
            parts.append(_wrapped(description) + "\n")
        if entries:
            parts.append("\n".join(entries) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
