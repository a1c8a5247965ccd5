"""Reward service: scores responses by rule per data_source, a custom function, or a reward
model; used by runs and alone for evaluation (`meshrl reward serve | eval`).

server.py          gRPC glue: Initialize, Score, ListScorers
client.py          the typed client, for the coordinator, evaluation and users
convert.py         ScoreItem / ScoreOutcome <-> protos
types.py           ScoreItem, ScoreOutcome and the service's errors
scoring.py         RewardScorer: scorers, reward model and custom function behind one call
pool.py            the scorer worker processes, with per-sample timeouts
scorer_process.py  what runs inside one scorer worker process
scorers/           the rule scorers per data_source (GSM8k, MATH, HellaSwag), custom functions
"""
