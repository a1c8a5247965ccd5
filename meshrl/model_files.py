"""The small files of a Hugging Face model folder that describe it (config, generation
config, tokenizer), copied beside weights written elsewhere: by checkpoints, so a saved
step is a loadable folder, and by exports."""

from __future__ import annotations

import shutil
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
