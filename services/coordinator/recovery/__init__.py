"""Surviving failures: bounded restarts of dead role servers, rollout replicas that leave and
rejoin, checkpoints (saved, verified, resumed) and the run's progress they hold."""
