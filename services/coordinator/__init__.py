"""Coordinator service: runs the PPO loop against the role servers, as a service
(`meshrl serve coordinator`) or in the `meshrl run` process.

server.py   gRPC glue: StartRun, WatchRun, StopRun, ListRuns
client.py   the typed client of the service (`meshrl run --coordinator`, status, stop)
convert.py  run status and events <-> protos
types.py    RunState, RunStatus, RunEvent, exit codes
run.py, ppo_step.py, validation.py, ...  the run and its step (no gRPC)
"""
