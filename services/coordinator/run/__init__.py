"""A run end to end: its checks before start, data, lifecycle and folder lock, the loop of
steps with validation (``PPORun``) and the service's manager of runs."""
