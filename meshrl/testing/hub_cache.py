"""A Hugging Face hub cache filled by hand: a model folder laid out as ``snapshot_download``
leaves one, so that hub ids resolve offline (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``) in
tests, with nothing downloaded."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def put_in_hub_cache(cache: str | Path, repo_id: str, model_dir: str | Path) -> Path:
    """Copies ``model_dir`` into ``cache`` as the ``main`` revision of the model
    ``repo_id`` (``models--org--name/refs/main`` naming a snapshot); returns the
    snapshot's folder."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # any 40 hex digits
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
