"""Trainer service: one role per server (actor, critic or reference) on FSDP2 ranks; rank 0
serves gRPC and hands each command to the other ranks.

server.py          gRPC glue: status codes, health, the command channel to other ranks
client.py          the typed client, for the coordinator and users
convert.py         request protos -> typed values, with their checks
types.py           SequenceBatch
rank_handlers.py   what every rank does with a command (no gRPC)
actor.py, critic.py, reference.py   the roles; weight_publisher.py the actor's weight sync
"""
