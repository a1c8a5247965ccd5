"""Who may talk to a meshrl server: TLS / mutual TLS, a shared token, the API version.

Every gRPC server (`GrpcServer`) and client (`open_channel`) of every process reads the same
settings from the environment, so a role server picks them up without its command line
knowing about them; launchers copy the run config's ``security`` section there
(`SecuritySettings.from_config(cfg.security).to_env()`). Set values of the config override
the environment.

    MESHRL_TLS_CERT, MESHRL_TLS_KEY   this server's certificate chain and key (PEM): TLS on
    MESHRL_TLS_CA                     CA bundle: servers verify client certificates with it,
                                      clients verify servers with it
    MESHRL_TLS_CLIENT_CERT, _KEY      the certificate a client presents (mutual TLS)
    MESHRL_TLS_REQUIRE_CLIENT_CERT    1: servers refuse clients without a certificate the CA signed
    MESHRL_AUTH_TOKEN_FILE            file holding the shared token; servers refuse calls without it

A client uses TLS as soon as any certificate setting is present (a CA, or a certificate of its
own); the server's certificate must name the host the clients dial (a DNS or IP
subjectAltName, e.g. 127.0.0.1).

Every call carries two metadata entries, added by `open_channel`:
``authorization: Bearer <token>`` (when a token is set) and
``meshrl-api-version: meshrl.api.v1``. Servers check the token first (UNAUTHENTICATED, with
what is missing), then the API version (FAILED_PRECONDITION naming both versions; a call
without the version entry, e.g. from grpcurl, is let through).

Health checks are not exempt: an unauthenticated peer learns nothing, not even that a role
is up. Our probes (`python -m meshrl.rpc.probe`, `wait_for_health`) go through
`open_channel` and so send the token and certificates like any client.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from collections import namedtuple
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import grpc

from meshrl.config.loader import ConfigError

log = logging.getLogger(__name__)

API_VERSION = "meshrl.api.v1"
API_VERSION_KEY = "meshrl-api-version"
TOKEN_KEY = "authorization"  # gRPC metadata keys are lower case
TOKEN_SCHEME = "Bearer "

ENV_VARS: dict[str, str] = {
    "tls_cert": "MESHRL_TLS_CERT",
    "tls_key": "MESHRL_TLS_KEY",
    "tls_ca": "MESHRL_TLS_CA",
    "client_cert": "MESHRL_TLS_CLIENT_CERT",
    "client_key": "MESHRL_TLS_CLIENT_KEY",
    "require_client_cert": "MESHRL_TLS_REQUIRE_CLIENT_CERT",
    "auth_token_file": "MESHRL_AUTH_TOKEN_FILE",
}
"""SecuritySettings field -> environment variable."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_VERSION = re.compile(r"^meshrl\.api\.v(\d+)")


class SecurityConfigError(ConfigError):
    """Security settings that cannot be used; the message names the setting and the file."""


@dataclass(frozen=True)
class SecuritySettings:
    """Paths of the PEM files and the token file; None = not set."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    require_client_cert: bool = False
    auth_token_file: str | None = None

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> SecuritySettings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, var in ENV_VARS.items():
            raw = env.get(var, "").strip()
            if name == "require_client_cert":
                values[name] = _parse_bool(var, raw)
            else:
                values[name] = raw or None
        return SecuritySettings(**values)

    @staticmethod
    def from_config(section) -> SecuritySettings:
        """From the run config's ``security`` section (or anything with the same fields)."""
        return SecuritySettings(
            **{f.name: getattr(section, f.name) for f in fields(SecuritySettings)}
        )

    def to_env(self) -> dict[str, str]:
        """The variables of the settings that are set, paths made absolute (children may run
        in another folder)."""
        out = {}
        for name, var in ENV_VARS.items():
            value = getattr(self, name)
            if name == "require_client_cert":
                if value:
                    out[var] = "1"
            elif value:
                out[var] = str(Path(value).expanduser().resolve())
        return out

    @property
    def server_tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def client_tls(self) -> bool:
        return any((self.tls_ca, self.tls_cert, self.client_cert))

    def check(self) -> None:
        """Raises SecurityConfigError for pairs set by halves and settings that need others."""
        for a, b in (("tls_cert", "tls_key"), ("client_cert", "client_key")):
            if bool(getattr(self, a)) != bool(getattr(self, b)):
                have, missing = (a, b) if getattr(self, a) else (b, a)
                raise SecurityConfigError(
                    f"security.{have} ({ENV_VARS[have]}) is set but security.{missing} "
                    f"({ENV_VARS[missing]}) is not; they come as a pair"
                )
        if self.require_client_cert and not (self.tls_cert and self.tls_ca):
            raise SecurityConfigError(
                "security.require_client_cert (MESHRL_TLS_REQUIRE_CLIENT_CERT) needs the server's "
                "own certificate (security.tls_cert/tls_key) and the CA that signs client "
                "certificates (security.tls_ca)"
            )

    def verify(self) -> None:
        """Checks the settings and reads every file they name, so a bad path fails at start
        with its name rather than as a server that never comes up."""
        self.check()
        for name in ("tls_cert", "tls_key", "tls_ca", "client_cert", "client_key"):
            if getattr(self, name):
                read_file(self, name)
        read_token(self)


def _parse_bool(var: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise SecurityConfigError(f"{var}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def read_file(settings: SecuritySettings, name: str) -> bytes:
    """The bytes of the file named by setting `name`; SecurityConfigError if unreadable."""
    path = getattr(settings, name)
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise SecurityConfigError(
            f"security.{name} ({ENV_VARS[name]}): cannot read {path}: {e.strerror or e}"
        ) from None
    if not data.strip():
        raise SecurityConfigError(f"security.{name} ({ENV_VARS[name]}): {path} is empty")
    return data


def read_token(settings: SecuritySettings) -> str | None:
    """The shared token (surrounding whitespace stripped), or None when none is set."""
    if not settings.auth_token_file:
        return None
    token = read_file(settings, "auth_token_file").decode("utf-8", "replace").strip()
    if any(c.isspace() or not c.isprintable() for c in token):
        raise SecurityConfigError(
            f"security.auth_token_file ({ENV_VARS['auth_token_file']}): the token in "
            f"{settings.auth_token_file} must be one line of printable characters, no spaces"
        )
    return token


# --- server side ---------------------------------------------------------------------
def server_credentials(settings: SecuritySettings) -> grpc.ServerCredentials | None:
    """TLS credentials of a server (client certificates required when asked), or None."""
    settings.check()
    if not settings.server_tls:
        return None
    pair = (read_file(settings, "tls_key"), read_file(settings, "tls_cert"))
    ca = read_file(settings, "tls_ca") if settings.tls_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=settings.require_client_cert
    )


def _metadata(details: grpc.HandlerCallDetails) -> dict[str, str]:
    return {m.key: m.value for m in details.invocation_metadata or ()}


def _rejecting(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str):
    """A handler of the same kind as `handler` that fails every call with `code`."""
    if handler is None:  # no such method: let gRPC answer UNIMPLEMENTED
        return None

    def abort(request, context):
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``authorization`` entry is not ``Bearer <token>``."""

    def __init__(self, token: str):
        self._expected = (TOKEN_SCHEME + token).encode()

    def intercept_service(self, continuation, handler_call_details):
        given = _metadata(handler_call_details).get(TOKEN_KEY)
        if given is None:
            message = (
                f"missing '{TOKEN_KEY}' metadata: this server requires the shared token "
                "(set MESHRL_AUTH_TOKEN_FILE or security.auth_token_file on the client)"
            )
        elif not hmac.compare_digest(given.encode(), self._expected):  # constant time
            message = (
                f"invalid token in '{TOKEN_KEY}' metadata: not the token this server was given"
            )
        else:
            return continuation(handler_call_details)
        log.warning("refused %s: %s", handler_call_details.method, message)
        return _rejecting(
            continuation(handler_call_details), grpc.StatusCode.UNAUTHENTICATED, message
        )


def api_major(version: str) -> int | None:
    """3 for "meshrl.api.v3", None when `version` is not of that form."""
    m = _VERSION.match(version)
    return int(m.group(1)) if m else None


class ApiVersionInterceptor(grpc.ServerInterceptor):
    """Refuses calls from clients of another major API version (FAILED_PRECONDITION)."""

    def __init__(self, version: str = API_VERSION):
        self.version = version
        self.major = api_major(version)

    def intercept_service(self, continuation, handler_call_details):
        given = _metadata(handler_call_details).get(API_VERSION_KEY)
        if given is None or api_major(given) == self.major:
            return continuation(handler_call_details)
        message = (
            f"API version mismatch: the client speaks {given!r}, this server speaks "
            f"{self.version!r}; run the same meshrl release on both sides"
        )
        return _rejecting(
            continuation(handler_call_details), grpc.StatusCode.FAILED_PRECONDITION, message
        )


def server_interceptors(settings: SecuritySettings, api_version: str = API_VERSION) -> list:
    """Token check first (a stranger learns nothing, not even our version), then the version."""
    token = read_token(settings)
    version = [ApiVersionInterceptor(api_version)]
    return ([TokenInterceptor(token)] if token else []) + version


# --- client side ---------------------------------------------------------------------
def channel_credentials(settings: SecuritySettings) -> grpc.ChannelCredentials | None:
    """TLS credentials of a client (with its own certificate for mutual TLS), or None."""
    settings.check()
    if not settings.client_tls:
        return None
    ca = read_file(settings, "tls_ca") if settings.tls_ca else None  # None: the system's roots
    if settings.client_cert:
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=read_file(settings, "client_key"),
            certificate_chain=read_file(settings, "client_cert"),
        )
    return grpc.ssl_channel_credentials(root_certificates=ca)


_CallDetails = namedtuple(
    "_CallDetails",
    ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
)


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):
    pass


class MetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata entries (API version, token) to every call of a channel."""

    def __init__(self, entries: list[tuple[str, str]]):
        self.entries = list(entries)

    def _with_entries(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(d.metadata or ()), *self.entries]
        return _ClientCallDetails(
            d.method,
            d.timeout,
            metadata,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_entries(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_entries(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_entries(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_entries(client_call_details), request_iterator)


def client_interceptor(
    settings: SecuritySettings, api_version: str = API_VERSION
) -> MetadataInterceptor:
    entries = [(API_VERSION_KEY, api_version)]
    token = read_token(settings)
    if token:
        entries.append((TOKEN_KEY, TOKEN_SCHEME + token))
    return MetadataInterceptor(entries)
