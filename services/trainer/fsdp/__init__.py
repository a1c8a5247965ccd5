"""The FSDP2 trainer backend (``strategy`` fsdp or fsdp2): Hugging Face models sharded with
``fully_shard`` over the role's ranks (``sharding.py``), built by ``backend.py``."""
