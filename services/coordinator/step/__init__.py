"""One PPO step: its phases in order over typed, frozen stages (generated -> scored ->
inferred -> trajectory), the batch sources that give it a batch, and the advantages."""
