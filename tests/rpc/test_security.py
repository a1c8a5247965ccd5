"""TLS, mutual TLS, the shared token and the API-version check, against real server processes
(the reward server, configured only through MESHRL_* environment variables) and in-process
servers. Certificates are made in the test; a second, unrelated CA plays the stranger."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshrl.api.v1 import common_pb2, reward_pb2_grpc
from meshrl.config import ConfigError, build_config
from meshrl.launcher.local import LocalLauncher, RoleProcess
from meshrl.launcher.ports import free_port
from meshrl.rpc.client import ServiceUnavailable, open_channel, wait_for_health
from meshrl.rpc.options import channel_options
from meshrl.rpc.security import (
    API_VERSION,
    SecurityConfigError,
    SecuritySettings,
    api_major,
    channel_credentials,
    client_interceptor,
)
from meshrl.rpc.server import GrpcServer

pytest.importorskip("cryptography")
from meshrl.testing.certs import CertFiles, make_certs  # noqa: E402

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[CertFiles, CertFiles, Path]:
    """Our CA's files, a stranger CA's files, and a token file."""
    folder = tmp_path_factory.mktemp("pki")
    token = folder / "token"
    token.write_text(TOKEN + "\n")
    return make_certs(folder, "ours"), make_certs(folder, "stranger"), token


def client_settings(
    certs: CertFiles, token: Path | None = None, mtls: bool = False
) -> SecuritySettings:
    return SecuritySettings(
        tls_ca=str(certs.ca),
        client_cert=str(certs.client_cert) if mtls else None,
        client_key=str(certs.client_key) if mtls else None,
        auth_token_file=str(token) if token else None,
    )


def get_info(address: str, security: SecuritySettings | None = None) -> common_pb2.ServerInfo:
    with open_channel(address, security) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        return stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)


def refusal(address: str, security: SecuritySettings) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        get_info(address, security)
    return e.value


class RewardServer:
    """`python -m services.reward.server` in its own process group; security from env only."""

    def __init__(self, log: Path, env: dict[str, str], ready: SecuritySettings):
        self.address = f"127.0.0.1:{free_port()}"
        self._log = log.open("w")
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MESHRL_")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.reward.server",
                "--port",
                self.address.split(":")[1],
                "--num-workers",
                "1",
            ],
            cwd=REPO,
            env={**clean, **env, "PYTHONUNBUFFERED": "1"},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:  # "" is SERVING once it listens; the scorer workers are not needed here
            wait_for_health(
                self.address, "", 60, alive=lambda: self.proc.poll() is None, security=ready
            )
        except BaseException:
            self.stop()
            raise RuntimeError(f"reward server did not start:\n{log.read_text()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # scorer workers too, by our group's id
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def tls_token_server(pki, tmp_path_factory):
    """TLS (no client certificates) + the shared token."""
    ours, _, token = pki
    env = {
        "MESHRL_TLS_CERT": str(ours.server_cert),
        "MESHRL_TLS_KEY": str(ours.server_key),
        "MESHRL_AUTH_TOKEN_FILE": str(token),
    }
    s = RewardServer(
        tmp_path_factory.mktemp("tls") / "server.log", env, client_settings(ours, token)
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mtls_server(pki, tmp_path_factory):
    """Mutual TLS: client certificates signed by our CA required; no token."""
    ours, _, _ = pki
    env = {
        "MESHRL_TLS_CERT": str(ours.server_cert),
        "MESHRL_TLS_KEY": str(ours.server_key),
        "MESHRL_TLS_CA": str(ours.ca),
        "MESHRL_TLS_REQUIRE_CLIENT_CERT": "1",
    }
    s = RewardServer(
        tmp_path_factory.mktemp("mtls") / "server.log", env, client_settings(ours, mtls=True)
    )
    yield s
    s.stop()


# --- TLS + token, real process ---------------------------------------------------------
@pytest.mark.slow
def test_tls_and_token_accepted(pki, tls_token_server):
    ours, _, token = pki
    info = get_info(tls_token_server.address, client_settings(ours, token))
    assert info.service == "reward" and info.api_version == API_VERSION


@pytest.mark.slow
def test_plaintext_client_refused_by_tls_server(pki, tls_token_server):
    _, _, token = pki
    err = refusal(tls_token_server.address, SecuritySettings(auth_token_file=str(token)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_server_of_another_ca_refused_by_client(pki, tls_token_server):
    _, stranger, token = pki
    err = refusal(tls_token_server.address, client_settings(stranger, token))
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no call is made


@pytest.mark.slow
def test_call_without_token_is_unauthenticated(pki, tls_token_server):
    ours, _, _ = pki
    err = refusal(tls_token_server.address, client_settings(ours))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "missing 'authorization' metadata" in err.details()
    assert "MESHRL_AUTH_TOKEN_FILE" in err.details()


@pytest.mark.slow
def test_wrong_token_is_unauthenticated(pki, tls_token_server, tmp_path):
    ours, _, _ = pki
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    err = refusal(tls_token_server.address, client_settings(ours, wrong))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid token" in err.details()


@pytest.mark.slow
def test_health_needs_the_token_and_probe_sends_it(pki, tls_token_server):
    ours, _, token = pki
    with open_channel(tls_token_server.address, client_settings(ours)) as channel:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # wait_for_health gives up at once on a refusal that waiting cannot change
    with pytest.raises(ServiceUnavailable, match="refused the health check: UNAUTHENTICATED"):
        wait_for_health(tls_token_server.address, "", 30, security=client_settings(ours))
    # the container probe reads the same environment as the servers
    env = {**os.environ, **client_settings(ours, token).to_env()}
    probe = subprocess.run(
        [sys.executable, "-m", "meshrl.rpc.probe", tls_token_server.address],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stdout + probe.stderr


# --- mutual TLS, real process -------------------------------------------------------------
@pytest.mark.slow
def test_mtls_accepts_a_client_certificate_of_our_ca(pki, mtls_server):
    ours, _, _ = pki
    assert get_info(mtls_server.address, client_settings(ours, mtls=True)).service == "reward"


@pytest.mark.slow
def test_mtls_refuses_a_client_without_certificate(pki, mtls_server):
    ours, _, _ = pki
    err = refusal(mtls_server.address, client_settings(ours))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_mtls_refuses_a_client_certificate_of_another_ca(pki, mtls_server):
    ours, stranger, _ = pki
    forged = replace(
        client_settings(ours, mtls=True),
        client_cert=str(stranger.client_cert),
        client_key=str(stranger.client_key),
    )
    err = refusal(mtls_server.address, forged)
    assert err.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_other_api_version_is_failed_precondition(pki, mtls_server):
    ours, _, _ = pki
    settings = client_settings(ours, mtls=True)
    raw = grpc.secure_channel(mtls_server.address, channel_credentials(settings), channel_options())
    with grpc.intercept_channel(raw, client_interceptor(settings, "meshrl.api.v2")) as channel:
        with pytest.raises(grpc.RpcError) as e:
            reward_pb2_grpc.RewardServiceStub(channel).GetInfo(
                common_pb2.GetInfoRequest(), timeout=10
            )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'meshrl.api.v2'" in e.value.details() and "'meshrl.api.v1'" in e.value.details()


# --- in-process servers (fast) -----------------------------------------------------------
@pytest.fixture
def plain_server():
    """An in-process GrpcServer with only the health service; insecure, no token."""
    server = GrpcServer("test.Service", "127.0.0.1", 0, security=SecuritySettings())
    server.start()
    yield f"127.0.0.1:{server.port}"
    server.stop(0)


def _health(channel: grpc.Channel, **kwargs) -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(), timeout=5, **kwargs)
        .status
    )


def test_api_version_header(plain_server):
    channel = grpc.insecure_channel(plain_server)
    try:
        # no header (grpcurl, grpc_health_probe): let through
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        # a later v1 minor and the exact version: let through
        for version in ("meshrl.api.v1", "meshrl.api.v1beta2"):
            assert _health(channel, metadata=[("meshrl-api-version", version)]) == 1
        for version in ("meshrl.api.v2", "garbage"):
            with pytest.raises(grpc.RpcError) as e:
                _health(channel, metadata=[("meshrl-api-version", version)])
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (
                e.value.details()
                == f"API version mismatch: the client speaks {version!r}, this server speaks "
                "'meshrl.api.v1'; run the same meshrl release on both sides"
            )
    finally:
        channel.close()
    with open_channel(plain_server, SecuritySettings()) as ours:  # sends meshrl.api.v1
        assert _health(ours) == health_pb2.HealthCheckResponse.SERVING


def test_token_on_an_in_process_server(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    server = GrpcServer("test.Service", security=SecuritySettings(auth_token_file=str(token)))
    server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        with open_channel(address, SecuritySettings(auth_token_file=str(token))) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        with open_channel(address, SecuritySettings()) as channel:
            with pytest.raises(grpc.RpcError) as e:
                _health(channel)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def test_settings_from_and_to_env(tmp_path):
    env = {
        "MESHRL_TLS_CERT": "c.pem",
        "MESHRL_TLS_KEY": "k.pem",
        "MESHRL_TLS_REQUIRE_CLIENT_CERT": "true",
        "MESHRL_TLS_CA": "ca.pem",
    }
    s = SecuritySettings.from_env(env)
    assert (s.tls_cert, s.tls_key, s.tls_ca, s.require_client_cert) == (
        "c.pem",
        "k.pem",
        "ca.pem",
        True,
    )
    assert s.server_tls and s.client_tls and s.auth_token_file is None
    out = s.to_env()
    assert out["MESHRL_TLS_CERT"] == str(Path("c.pem").resolve())
    assert out["MESHRL_TLS_REQUIRE_CLIENT_CERT"] == "1" and "MESHRL_AUTH_TOKEN_FILE" not in out
    assert SecuritySettings.from_env({}) == SecuritySettings()
    with pytest.raises(SecurityConfigError, match="MESHRL_TLS_REQUIRE_CLIENT_CERT='maybe'"):
        SecuritySettings.from_env({"MESHRL_TLS_REQUIRE_CLIENT_CERT": "maybe"})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            SecuritySettings(tls_cert="c"),
            r"security.tls_cert \(MESHRL_TLS_CERT\) is set but security.tls_key",
        ),
        (
            SecuritySettings(client_key="k"),
            "security.client_key .* is set but security.client_cert",
        ),
        (
            SecuritySettings(tls_cert="c", tls_key="k", require_client_cert=True),
            "require_client_cert",
        ),
    ],
)
def test_half_set_settings_are_named(settings, message):
    with pytest.raises(SecurityConfigError, match=message):
        settings.check()


def test_unreadable_files_are_named(tmp_path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(
        SecurityConfigError, match=rf"security.tls_ca \(MESHRL_TLS_CA\): cannot read {missing}"
    ):
        SecuritySettings(tls_ca=str(missing)).verify()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecurityConfigError, match="is empty"):
        SecuritySettings(auth_token_file=str(empty)).verify()
    with pytest.raises(
        SecurityConfigError, match="cannot read"
    ):  # a server never starts half-secured
        GrpcServer(
            "test.Service", security=SecuritySettings(tls_cert=str(missing), tls_key=str(missing))
        )


def test_config_section_is_validated_and_reaches_the_children(pki, tmp_path, monkeypatch):
    ours, _, token = pki
    with pytest.raises(ConfigError, match="security.client_cert is set but security.client_key"):
        build_config({}, [f"security.client_cert={ours.client_cert}"])
    cfg = build_config(
        {},
        [
            f"security.tls_cert={ours.server_cert}",
            f"security.tls_key={ours.server_key}",
            f"security.tls_ca={ours.ca}",
            "security.require_client_cert=true",
            f"security.client_cert={ours.client_cert}",
            f"security.client_key={ours.client_key}",
            f"security.auth_token_file={token}",
        ],
    )
    # a real child of each start method prints the environment it was given
    dump = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    for method in ("forkserver", "spawn"):
        launcher = LocalLauncher(cfg.model_copy(deep=True), tmp_path / method)
        launcher.cfg.launcher.start_method = method
        launcher.log_dir.mkdir(parents=True)
        proc = RoleProcess("reward", dump, "127.0.0.1:1", launcher.log_dir / "r.log")
        launcher._spawn(proc)
        assert proc.popen.wait(timeout=60) == 0, proc.log_path.read_text()
        seen = json.loads(proc.log_path.read_text().strip().splitlines()[-1])
        assert SecuritySettings.from_env(seen) == SecuritySettings.from_config(cfg.security)


def test_api_major():
    assert api_major("meshrl.api.v1") == 1 and api_major("meshrl.api.v12beta") == 12
    assert api_major("v1") is None
