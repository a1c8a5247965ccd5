"""What every section shares: the :class:`Section` base (unknown keys fail, field docstrings
are the documentation) and the value types several sections use."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict

from meshrl.algorithms.registry import ESTIMATORS, POLICY_LOSSES

# The KL estimators of meshrl.algorithms.kl.KL_ESTIMATOR_KINDS, named here so that loading a
# config does not import torch (tests/config checks the two lists agree). "+": straight-through.
KLEstimator = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
]  # fmt: skip


# The names of the advantage estimators and policy losses are their registry's
# (meshrl/algorithms/registry.py, torch-free): an entry added there is a value allowed here,
# described in docs/config.md. The type checker sees a plain str.
if TYPE_CHECKING:
    EstimatorName = str
    PolicyLossName = str
else:
    EstimatorName = Literal[tuple(ESTIMATORS)]
    PolicyLossName = Literal[tuple(POLICY_LOSSES)]


_Item = TypeVar("_Item")


def _one_item_list(value: object) -> object:
    """A single string as a one-item list; anything else goes on to the list check as is."""
    return [value] if isinstance(value, str) and value else value


# verl (through Hydra) takes `data.train_files=/data/train.parquet` or `trainer.logger=console`
# where a list is meant; its scripts nearly all start that way. Only a non-empty string is
# wrapped: a number, a mapping or `key=` (nothing: an empty list or a slip?) is still refused
# as "Input should be a valid list".
OneOrList = Annotated[list[_Item], BeforeValidator(_one_item_list)]


def _files_list(value: object) -> object:
    """Data files: ``null`` (``data.val_files=null``, as verl's configs write "none") is no
    files, a single path a list of one."""
    return [] if value is None else _one_item_list(value)


FileList = Annotated[list[_Item], BeforeValidator(_files_list)]


def _home_expanded(value: object) -> object:
    """``~/x`` as the home folder's ``x``: a shell leaves ``key=~/x`` as typed (the word
    does not start with ``~``), and the files would be looked for in a folder named ``~``."""
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


# A file or folder path of the config (data files, model folders, the run folder, ...).
PathText = Annotated[str, BeforeValidator(_home_expanded)]


# verl's short names of dtypes (`fsdp_config.model_dtype=bf16`), as the long ones here.
_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16"}


def dtype_name(value: object) -> object:
    return _DTYPE_NAMES.get(value, value) if isinstance(value, str) else value


class Section(BaseModel):
    """Base of every section: unknown keys fail, field docstrings are the documentation."""

    # coerce_numbers_to_str: YAML reads `experiment_name=2024` as an int; a text key takes it
    # as text, as Hydra does for verl users.
    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        coerce_numbers_to_str=True,
    )
