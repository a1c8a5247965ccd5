"""A health probe for containers: `python -m meshrl.rpc.probe HOST:PORT [--service NAME]`.

Asks the standard gRPC health service once; exits 0 when SERVING, 1 otherwise (what
Docker's HEALTHCHECK and compose's `healthcheck.test` expect). The overall service ("")
is SERVING once a role server listens; a role's own service name (e.g.
meshrl.api.v1.RolloutService) only once its model is loaded.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshrl.rpc.client import open_channel


def check(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The status name (SERVING, NOT_SERVING, ...) or the gRPC error code's name."""
    # open_channel: TLS and the token from the environment, like every meshrl client.
    with open_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m meshrl.rpc.probe", description=__doc__.split("\n")[0]
    )
    p.add_argument("address", help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="service name to ask about ('' = the server)")
    p.add_argument("--timeout-s", type=float, default=3.0)
    args = p.parse_args(argv)
    status = check(args.address, args.service, args.timeout_s)
    print(f"{args.address} {args.service or '<server>'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
