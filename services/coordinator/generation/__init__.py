"""Getting responses out of rollout: the replica pool and its gate, what a request asks for,
the KV cache's sleep and wake, multi-turn rollouts with an environment, generation ahead of
the step (one step off policy, fully async) and the actor's weights going to rollout."""
