"""Picks the launcher named by `launcher.kind`; every launcher has start() -> Endpoints, stop()."""

from __future__ import annotations

from pathlib import Path

from meshrl.config import RunConfig


def make_launcher(cfg: RunConfig, run_dir: Path):
    """local: subprocesses here; external: servers already running; ray: Ray actors."""
    kind = cfg.launcher.kind
    if kind == "local":
        from meshrl.launcher.local import LocalLauncher

        return LocalLauncher(cfg, run_dir)
    if kind == "external":
        from meshrl.launcher.external import ExternalLauncher

        return ExternalLauncher(cfg)
    if kind == "ray":
        from meshrl.launcher.ray_launcher import RayLauncher

        return RayLauncher(cfg, run_dir)
    raise ValueError(f"launcher.kind: unknown launcher {kind!r}")
