"""`python -m meshrl.rpc.probe HOST:PORT`: the health check of the compose services."""

from __future__ import annotations

from meshrl.launcher.ports import free_port
from meshrl.rpc.probe import check, main
from meshrl.rpc.server import GrpcServer


def test_probe_reports_server_and_role_health(capsys):
    server = GrpcServer("meshrl.api.v1.RolloutService", "127.0.0.1", 0)
    server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        assert main([address]) == 0  # the process listens
        assert main([address, "--service", "meshrl.api.v1.RolloutService"]) == 1  # no model yet
        server.mark_ready()
        assert check(address, "meshrl.api.v1.RolloutService") == "SERVING"
        assert "SERVING" in capsys.readouterr().out
    finally:
        server.stop(grace=0)
    assert main([f"127.0.0.1:{free_port()}", "--timeout-s", "1"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out
