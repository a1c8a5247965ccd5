"""The local launcher when a role server's port is taken between `free_port()` and its bind."""

from __future__ import annotations

import socket

import pytest

from meshrl.config import build_config
from meshrl.launcher import local, ports
from meshrl.launcher.local import LocalLauncher

pytestmark = pytest.mark.timeout(180)


def test_server_that_lost_its_port_starts_on_another(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # another process's server got there first
    busy = taken.getsockname()[1]
    picks = iter([busy])
    real_free_port = local.free_port
    # The first port handed out is the taken one; every later one is really free.
    monkeypatch.setattr(
        local, "free_port", lambda host="127.0.0.1": next(picks, None) or real_free_port(host)
    )
    launcher = LocalLauncher(build_config({}, []), tmp_path)
    server = launcher.plan()[0]  # a real role server (rollout0), planned on the taken port
    assert server.address == f"127.0.0.1:{busy}"
    launcher.log_dir.mkdir(parents=True)
    try:
        launcher._spawn(server)
        launcher._wait_until_serving(server)  # exits on the bind, is started again elsewhere
        assert server.alive() and server.address != f"127.0.0.1:{busy}"
        assert f"port {busy} is already in use" in server.log_path.read_text()
        assert launcher.processes["rollout0"].address == server.address  # what endpoints() reads
    finally:
        launcher.stop()
        taken.close()


def test_restart_moves_a_server_whose_port_was_taken(tmp_path):
    launcher = LocalLauncher(build_config({}, []), tmp_path)
    server = launcher.plan()[0]
    launcher.log_dir.mkdir(parents=True)
    taken = socket.socket()
    try:
        launcher._spawn(server)
        launcher._wait_until_serving(server)
        old_port = int(server.address.rsplit(":", 1)[1])
        server.popen.kill()  # the crash
        server.popen.wait()
        # The killed server's side of its health-check connections sits in TIME_WAIT on
        # this port; without SO_REUSEADDR that alone refuses the bind (CI lost a run to it).
        # A listening socket still refuses it, which is what the restart must meet.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", old_port))  # someone else takes the port before the restart
        taken.listen()
        address = launcher.restart("rollout0")
        assert address == server.address != f"127.0.0.1:{old_port}"
        assert server.alive()
        assert f"port {old_port} is already in use" in server.log_path.read_text()
    finally:
        launcher.stop()
        taken.close()


def test_plan_never_hands_out_one_port_twice(tmp_path, monkeypatch):
    # The OS may give back a port it just released: here every pick repeats once. Two of
    # our servers on one port would answer each other's health checks.
    real_free_port = local.free_port
    last = []

    def repeating(host="127.0.0.1"):
        if last and len(last) % 2:
            port = last[-1]
        else:
            port = real_free_port(host)
        last.append(port)
        return port

    monkeypatch.setattr(local, "free_port", repeating)
    cfg = build_config({}, ["actor_rollout_ref.actor.world_size=2", "critic.world_size=2"])
    procs = LocalLauncher(cfg, tmp_path).plan()
    ports = [int(p.address.rsplit(":", 1)[1]) for p in procs]
    masters = [
        int(arg.split("=", 1)[1])
        for p in procs
        for arg in p.command
        if arg.startswith("--master_port=")
    ]
    assert len(masters) == 2  # actor and critic run as two ranks each
    assert len(set(ports + masters)) == len(ports) + len(masters)
    assert len(last) > len(ports) + len(masters)  # repeats were drawn and passed over


def test_a_foreign_server_on_the_port_is_not_taken_for_ours(tmp_path):
    # Another process's gRPC server (its overall health SERVING) answers on the port planned
    # for ours. The launcher waits for the health of the instance it started, so it does
    # not take that server for ours: ours fails to bind, and is started again elsewhere.
    from meshrl.launcher.local import _move_to_port
    from meshrl.rpc.server import GrpcServer

    foreign = GrpcServer("meshrl.rollout.v1.RolloutService")
    foreign.start()
    launcher = LocalLauncher(build_config({}, []), tmp_path)
    server = launcher.plan()[0]
    _move_to_port(server, "127.0.0.1", foreign.port)
    launcher.log_dir.mkdir(parents=True)
    try:
        launcher._spawn(server)
        launcher._wait_until_serving(server)
        assert server.alive() and server.address != f"127.0.0.1:{foreign.port}"
        assert f"port {foreign.port} is already in use" in server.log_path.read_text()
    finally:
        launcher.stop()
        foreign.stop(grace=0)


def test_free_ports_come_from_below_the_range_the_os_hands_out_itself():
    # A port-0 bind elsewhere (torchrun's rendezvous, gloo, a client) cannot take ours
    # between `free_port()` and the server's bind: the OS only gives out ephemeral ports.
    rng = ports.ephemeral_range()
    if rng is None or rng[0] - ports.LOWEST_PORT < 1000:
        pytest.skip(f"no room below the ephemeral range here ({rng}): the OS picks")
    low, _ = rng
    picked = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST_PORT <= p < low for p in picked)
    assert len(picked) > 1  # drawn at random, not one fixed port for every process
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked.pop()))  # and it was free


def test_free_port_names_a_host_it_cannot_bind_at_once():
    # only a taken port is tried again; an address that is not this machine's is an error
    with pytest.raises(OSError):
        ports.free_port("192.0.2.1")  # TEST-NET-1: never a local address


def test_free_port_falls_back_to_the_os_pick_where_the_range_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
