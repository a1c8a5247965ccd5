"""Channel and server options, set deliberately in one place.

Rollout batches are large (B·n responses of up to thousands of tokens, plus log-probs), so
the 4 MiB default message limit of gRPC is far too small; 512 MiB holds a batch of 256×8
responses of 8k tokens with room to spare while still refusing a runaway message.
"""

from __future__ import annotations

import os

MAX_MESSAGE_ENV = "MESHRL_GRPC_MAX_MESSAGE_MB"

_GRPC_CEILING = 2**31 - 1
"""gRPC takes the limits as a C int (2048 MiB raised OverflowError when a server or channel was
built), and protobuf cannot encode a message of 2 GiB or more anyway."""


def max_message_bytes(raw: str | None) -> int:
    """The limit in bytes from the variable's text (MiB, default 512); a bad value fails
    naming the variable, and one past gRPC's ceiling becomes the ceiling."""
    try:
        mib = float(raw or "512")
    except ValueError:
        raise ValueError(
            f"{MAX_MESSAGE_ENV}={raw!r}: expected a number of MiB, e.g. 1024"
        ) from None
    if not mib > 0:  # NaN too
        raise ValueError(f"{MAX_MESSAGE_ENV}={raw!r}: the limit must be more than 0 MiB")
    return int(min(mib * 1024 * 1024, _GRPC_CEILING))


def message_limit() -> int:
    """This process's limit: MESHRL_GRPC_MAX_MESSAGE_MB (same value on every process of a
    run), read when a channel or server is made (a forked server's environment is set
    after its modules were imported). A message over it is refused with
    RESOURCE_EXHAUSTED; the receiving server lives on."""
    return max_message_bytes(os.environ.get(MAX_MESSAGE_ENV))


def channel_options() -> list[tuple[str, int]]:
    limit = message_limit()
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        # Detect a dead peer on an idle connection within ~30 s instead of TCP's minutes.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> list[tuple[str, int]]:
    return channel_options() + [
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # Refuse to share a port with a stale server left by a crashed run.
        ("grpc.so_reuseport", 0),
    ]
