"""The small files of a Hugging Face model folder that describe it (config, generation
config, tokenizer), copied beside weights written elsewhere: by checkpoints, so a saved
step is a loadable folder, and by exports."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Small files of a model folder that describe it (not weights): the model's, then the
# tokenizer's.
MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
HF_SIDE_FILES = MODEL_FILES + TOKENIZER_FILES


def copy_side_files(model_dir: Path, dest: Path, names: tuple[str, ...] = HF_SIDE_FILES) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, dest / name)


def copy_model_files(model_dir: Path, tokenizer_dir: Path | None, dest: Path) -> None:
    """A model folder's side files, the tokenizer's from `tokenizer_dir` when it is another
    folder: only its tokenizer files, as its config.json (another model's, often) must not
    replace the model's."""
    copy_side_files(model_dir, dest)
    if tokenizer_dir is not None:
        copy_side_files(tokenizer_dir, dest, TOKENIZER_FILES)


def unreadable_weights(folder: str | Path) -> str | None:
    """The first ``*.safetensors`` file of a model folder whose header does not parse (a
    file cut short, a download that saved an error page, a Git LFS pointer), with the
    reason; None when every one reads. Headers only: no tensor is loaded."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike: named
            return f"{path} is not a readable safetensors file ({e})"
    return None


@contextmanager
def naming_bad_weights(folder: str | Path) -> Iterator[None]:
    """Around a model's load from ``folder``: a failure whose cause is a weights file that
    does not parse is a ValueError naming that file (transformers' own error names none:
    ``Error while deserializing header: header too large``)."""
    try:
        yield
    except Exception as e:
        if Path(folder).is_dir() and (problem := unreadable_weights(folder)) is not None:
            raise ValueError(f"the model's weights cannot be read: {problem}") from e
        raise
