"""Every key of the run config is documented: each field of every model reachable from
RunConfig has an attribute docstring, which pydantic (``use_attribute_docstrings``) makes its
``description``."""

import typing

from pydantic import BaseModel

from meshrl.config import RunConfig


def models_in(annotation: object) -> list[type[BaseModel]]:
    """The models an annotation holds, however nested (``X | None``, ``list[X]``,
    ``dict[str, X]``, ``Annotated[...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in models_in(arg)]


def undocumented_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys under ``model`` whose field has no (or a blank) description."""
    missing = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if not (field.description or "").strip():
            missing.append(key)
        for inner in models_in(field.annotation):
            missing += undocumented_keys(inner, f"{key}.")
    return missing


def test_the_walk_reaches_nested_sections():
    # A walk that stopped at the top sections would pass without checking anything.
    keys = set()

    def collect(model: type[BaseModel], prefix: str = "") -> None:
        for name, field in model.model_fields.items():
            keys.add(f"{prefix}{name}")
            for inner in models_in(field.annotation):
                collect(inner, f"{prefix}{name}.")

    collect(RunConfig)
    assert "actor_rollout_ref.actor.policy_loss.loss_mode" in keys
    assert "actor_rollout_ref.rollout.weight_sync.transport" in keys
    assert "launcher.resource_pool.gpus_per_node" in keys  # through dict[str, Model]


def test_every_config_key_has_a_docstring():
    missing = undocumented_keys(RunConfig)
    assert not missing, (
        f"{len(missing)} config key(s) without a docstring (add one under the field in "
        "meshrl/config/sections/):\n  " + "\n  ".join(missing)
    )
