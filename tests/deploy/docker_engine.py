"""A private Docker engine for the deploy tests: Debian's docker.io, started by the test.

`DockerEngine.start()` installs docker.io, docker-compose and debootstrap with apt-get when
they are missing (root only), then starts `dockerd` on its own socket, exec-root and
data-root, so it never touches another engine on the machine. It tries the overlay2
storage driver first (a container starts in well under a second) and falls back to vfs
(every start copies the whole image: ~30 s for ours), both with `--iptables=false
--bridge=none`: containers use the host network. The data-root is kept between runs
(MESHRL_DOCKER_ROOT, default /var/lib/meshrl-test-docker) so the base image and the
dependency layer stay cached; Docker's cache is keyed by content, so this is safe.

Any reason the engine cannot run here becomes `DockerUnavailable(reason)`: tests skip
with it, or fail with it under CI (`docker_unavailable`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

PACKAGES = {
    "dockerd": "docker.io",
    "docker-compose": "docker-compose",
    "debootstrap": "debootstrap",
}
DRIVERS = ("overlay2", "vfs")


class DockerUnavailable(RuntimeError):
    """Docker cannot run on this machine; the message says why."""


def docker_unavailable(reason: str) -> None:
    """Skips the test, or fails it under CI (``CI=true``): there the Docker tests must run,
    so that a green CI run is one that ran them."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Docker cannot run here, and CI=true requires the Docker tests: {reason}")
    pytest.skip(f"Docker cannot run here: {reason}")


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def ensure_installed() -> None:
    """apt-get installs whichever of docker.io, docker-compose, debootstrap is missing."""
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if not shutil.which(tool)})
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise DockerUnavailable(
            f"{', '.join(missing)} missing and cannot be installed (needs root and apt-get)"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    update = _run(["apt-get", "update", "-q"], 600, env=env)
    install = _run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], 900, env=env
    )
    if install.returncode != 0:
        raise DockerUnavailable(
            f"apt-get install {' '.join(missing)} failed:\n{update.stderr[-800:]}{install.stderr[-1500:]}"
        )


class DockerEngine:
    """One dockerd of our own; `env` points docker, docker-compose and docker-py at it."""

    def __init__(self, root: Path | None = None, run_dir: Path = Path("/run/meshrl-test-docker")):
        self.root = Path(
            root or os.environ.get("MESHRL_DOCKER_ROOT", "/var/lib/meshrl-test-docker")
        )
        self.run_dir = run_dir
        self.socket = run_dir / "docker.sock"
        self.proc: subprocess.Popen | None = None
        self.driver = ""
        self.log_path = run_dir / "dockerd.log"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DOCKER_HOST": f"unix://{self.socket}",
            "TESTCONTAINERS_RYUK_DISABLED": "true",  # its reaper image comes from a registry
            "COMPOSE_INTERACTIVE_NO_CLI": "1",
            # vfs copies the whole image for each container: six at once take minutes
            "COMPOSE_HTTP_TIMEOUT": "900",
        }

    def docker(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess:
        out = _run(["docker", *args], timeout, env=self.env)
        if check and out.returncode != 0:
            raise RuntimeError(
                f"docker {' '.join(args)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
            )
        return out

    def start(self) -> DockerEngine:
        if os.geteuid() != 0:
            raise DockerUnavailable("dockerd needs root")
        ensure_installed()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        errors = []
        for driver in (
            (os.environ.get("MESHRL_DOCKER_DRIVER"),)
            if os.environ.get("MESHRL_DOCKER_DRIVER")
            else DRIVERS
        ):
            try:
                self._start_daemon(driver)
                self.driver = driver
                return self
            except DockerUnavailable as e:
                errors.append(f"{driver}: {e}")
                self.stop()
        raise DockerUnavailable("dockerd did not start:\n" + "\n".join(errors))

    def _start_daemon(self, driver: str) -> None:
        cmd = [
            "dockerd",
            f"--storage-driver={driver}",
            "--iptables=false",
            "--bridge=none",
            f"--data-root={self.root / driver}",
            f"--exec-root={self.run_dir / 'exec'}",
            f"--pidfile={self.run_dir / 'dockerd.pid'}",
            f"--host=unix://{self.socket}",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DockerUnavailable(
                    f"dockerd exited ({self.proc.returncode}):\n{self._log_tail()}"
                )
            if (
                self.socket.exists()
                and self.docker("info", timeout=20, check=False).returncode == 0
            ):
                return
            time.sleep(0.5)
        raise DockerUnavailable(f"dockerd not answering after 60 s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-1500:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stops our dockerd (and the containerd it started) and waits for it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
