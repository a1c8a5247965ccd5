"""The embedded default run (`make demo`): a tiny model learns two-digit addition by PPO."""
