"""docs/config.md is what `python -m meshrl.config.docs` writes from the schema: a key
added, renamed or re-documented in meshrl/config/sections/ fails here until the page is
written again (`make config-docs`)."""

from pathlib import Path

from pydantic import BaseModel

from meshrl.config import RunConfig
from meshrl.config.docs import COMMAND, render, type_name

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_the_checked_in_page_is_current():
    assert PAGE.read_text() == render(), (
        f"docs/config.md is out of date with meshrl/config/sections/: run `{COMMAND}` "
        "(make config-docs) and commit the page"
    )


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_every_key_has_an_entry():
    page = render()
    missing = [key for key in _keys(RunConfig) if f"**`{key}`**" not in page]
    assert not missing, missing
    assert "**`launcher.resource_pool.<name>.gpus_per_node`**" in page  # through dict[str, X]


def test_an_entry_says_type_bounds_default_and_docstring():
    page = render()
    assert (
        "- **`data.train_batch_size`** (int, > 0; default `256`): Prompts per PPO step.\n" in page
    )
    assert (
        "**`data.train_files`** (list of path (one value alone: a list of one; null: none); "
        "default `[]`)" in (" ".join(page.split()))
    )


def test_type_names():
    from typing import Literal

    assert type_name(int | None) == "int or null"
    assert type_name(Literal["a", "b", "c"]) == "`a`, `b` or `c`"
    assert type_name(dict[str, list[float]]) == "mapping of string to list of float"
    assert type_name(tuple[float, float]) == "[float, float]"
