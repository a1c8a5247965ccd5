"""``security``: TLS and the shared token of the run's gRPC servers and clients."""

from __future__ import annotations

from meshrl.config.sections.base import PathText, Section


class SecurityConfig(Section):
    """TLS / mutual TLS and the shared token of every gRPC server and client of the run.

    The launcher hands these to each role server as MESHRL_TLS_* / MESHRL_AUTH_TOKEN_FILE
    (see meshrl/rpc/security.py); paths are read where each process runs.
    """

    tls_cert: PathText | None = None
    """PEM certificate chain of the servers; set (with tls_key) = TLS on every server."""
    tls_key: PathText | None = None
    """PEM private key of tls_cert."""
    tls_ca: PathText | None = None
    """PEM CA bundle: clients verify servers with it; servers verify client certificates."""
    client_cert: PathText | None = None
    """PEM certificate clients present (mutual TLS)."""
    client_key: PathText | None = None
    """PEM private key of client_cert."""
    require_client_cert: bool = False
    """Servers refuse clients without a certificate signed by tls_ca (mutual TLS)."""
    auth_token_file: PathText | None = None
    """File holding the shared token; servers refuse calls without it, clients send it."""
