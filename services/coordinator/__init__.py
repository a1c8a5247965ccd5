"""Coordinator service: runs the PPO loop against the role servers, as a service
(`meshrl serve coordinator`) or in the `meshrl run` process.

server.py    gRPC glue: StartRun, WatchRun, StopRun, ListRuns
client.py    the typed client of the service (`meshrl run --coordinator`, status, stop)
convert.py   run status and events <-> protos
types.py     RunState, RunStatus, RunEvent, exit codes

The run and its step (no gRPC), by concern, each package importing only those below it:
run/         the run end to end: checks, data, lifecycle, the loop, validation
recovery/    restarts, pool membership, checkpoints and the progress they hold
step/        one PPO step: phases over typed stages, batch sources, advantages
generation/  rollout's replica pool, requests, KV memory, multi-turn, weight sync
roles/       the role servers' clients and their start-up
metrics/     sinks, history, plots, validation metrics, generation dumps
"""
