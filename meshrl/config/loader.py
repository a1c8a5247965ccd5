"""Loads a run config: YAML file + dotted `key=value` overrides, validated at once.

Errors name the offending key (`actor_rollout_ref.actor.clip_ratio: Input should be a valid
number`) so a typo fails at start, not hours into a run; every problem of a config is reported
in one message. Overrides take verl's command lines as they are: Hydra's `+key=value` and
`++key=value` set the key like `key=value` (every key is in the schema).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import ValidationError

from meshrl.config.errors import ConfigError
from meshrl.config.schema import RunConfig
from meshrl.config.unknown_keys import unknown_key_lines
from meshrl.config.verl_keys import drop_same_meaning


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as YAML, so 1e-3, true, [a,b] work).

    Hydra's `+a.b=value` (add) and `++a.b=value` (add or override) are `a.b=value` here: the
    schema already has every key, so adding one and setting it are the same thing. Its
    `~a.b` (delete) is refused: a schema key always has a value.
    """
    if item.startswith("~"):
        raise ConfigError(
            f"override {item!r}: deleting a key (Hydra's ~) is not supported; leave the "
            "override out, or set the key to the value you want"
        )
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.removeprefix("++") if key.startswith("++") else key.removeprefix("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part")
    try:
        value = load_yaml(raw, f"override {key}") if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from None
    return key.split("."), value


def _unannotated(annotation: Any) -> Any:
    """``str`` for ``Annotated[str, ...]`` (a path, say); the annotation itself otherwise."""
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def _text_field(path: list[str]) -> bool:
    """Whether ``path`` names a text field of the schema (``str`` or ``str | None``)."""
    model: Any = RunConfig
    for i, part in enumerate(path):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        annotation = fields[part].annotation
        if i == len(path) - 1:
            return annotation is str or (
                get_origin(annotation) in (Union, UnionType)
                and {_unannotated(a) for a in get_args(annotation)} == {str, type(None)}
            )
        model = annotation
    return False


def _apply_overrides(tree: dict, overrides: list[str]) -> list[str]:
    """Sets each usable override in ``tree``; returns what is wrong with the others."""
    problems = []
    for item in overrides:
        try:
            _apply_override(tree, item)
        except ConfigError as e:
            problems.append(str(e))
    return problems


def _apply_override(tree: dict, item: str) -> None:
    path, value = parse_override(item)
    if _text_field(path) and not isinstance(value, (str, list, dict, type(None))):
        # The text as typed: YAML 1.1 reads experiment_name=2024_01_05 as the number
        # 20240105, 0123 as 83 (octal), yes as true and 2024-01-05 as a date. Quoted
        # text stays YAML's (quotes removed), and `null` still means None.
        value = item.split("=", 1)[1]
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = child
    node[path[-1]] = value


_INTERP = re.compile(r"\$\{([a-zA-Z0-9_.]+)\}")


def _lookup(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"interpolation ${{{dotted}}} names no key")
        node = node[part]
    return node


def _interpolate(tree: dict) -> dict:
    """Resolves `${a.b}` references in string values against the validated tree."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str):
            return _INTERP.sub(lambda m: str(_lookup(tree, m.group(1))), node)
        return node

    return walk(tree)


def _validation_problems(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<config>"
        if e["type"] == "extra_forbidden":
            lines += unknown_key_lines(e["loc"], e.get("input"))
        elif e["type"] == "value_error":  # our validators: the message names its keys
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(msg if key == "<config>" or msg.startswith(key) else f"{key}: {msg}")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return lines


def _validate(tree: dict) -> tuple[RunConfig | None, list[str]]:
    try:
        cfg = RunConfig.model_validate(tree)
        return RunConfig.model_validate(_interpolate(cfg.model_dump())), []
    except ValidationError as e:
        return None, _validation_problems(e)


def build_config(tree: dict | None = None, overrides: list[str] | None = None) -> RunConfig:
    # A deep copy: overrides land in nested sections, which must stay the caller's own (a
    # tree reused for several configs would otherwise carry one's overrides into the next).
    tree = copy.deepcopy(tree or {})
    # The tree is validated even when some overrides could not be read, so that one message
    # names every problem rather than the first of several rounds.
    problems = _apply_overrides(tree, list(overrides or []))
    drop_same_meaning(tree)
    cfg, invalid = _validate(tree)
    problems += invalid
    if problems or cfg is None:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    return cfg


_MERGE = "tag:yaml.org,2002:merge"


def _refuse_repeated_keys(node: yaml.Node, seen: set[int] | None = None) -> None:
    """Raises a YAML error at a key given twice in one mapping of the composed document:
    plain YAML keeps the last, so a setting edited further down a long config would
    silently undo one above. Checked on the nodes as written, before anything is built
    (building merges ``<<: *anchor`` keys into their mappings, in place). Keys are compared
    as written: scalars by tag and text."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias: the anchored node is checked once
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE:
                line = key.start_mark.line + 1
                first = lines.get((key.tag, key.value))
                if first is not None:
                    where = f"line {line}" if first == line else f"lines {first} and {line}"
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key.value!r} is given twice ({where})", key.start_mark
                    )
                lines[(key.tag, key.value)] = line
            _refuse_repeated_keys(key, seen)
            _refuse_repeated_keys(value, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_repeated_keys(item, seen)


def load_yaml(text: str, name: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping; its errors' marks
    name ``name``, not "<unicode string>"."""
    loader = yaml.SafeLoader(text)
    loader.name = name
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_repeated_keys(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def config_tree(text: str, name: str) -> dict:
    """The YAML mapping of a config's text; ``name`` says where it came from in errors
    (``config file run.yaml``), its line and column marks included."""
    try:
        tree = load_yaml(text, name)
    except yaml.YAMLError as e:
        raise ConfigError(f"{name} is not valid YAML: {e}") from None
    if tree is None:  # empty, or comments only
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{name} must hold a mapping at the top level")
    return tree


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        tree = config_tree(path.read_text(), f"config file {path}")
    return build_config(tree, overrides)


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_from_yaml(text: str) -> RunConfig:
    """The resolved config as sent to role servers in Initialize."""
    return build_config(yaml.safe_load(text) or {})
