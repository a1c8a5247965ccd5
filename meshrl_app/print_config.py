"""`meshrl run CONFIG [key=value ...] --print-config`: the config a run would use, as YAML.

What is printed is the resolved config: the file, then the overrides, then the defaults of
every key left out, verl's keys translated (`trainer.n_gpus_per_node=1` shown as
`trainer.device: cuda`) and `${...}` references filled in. It is itself a complete config:
`meshrl run resolved.yaml` runs the same. Nothing is started and no data file is read.
"""

from __future__ import annotations

import sys

from meshrl.config import build_config, config_to_yaml, load_config
from meshrl.config.loader import config_tree


def print_resolved_config(config_path: str | None, overrides: list[str]) -> int:
    """Prints the resolved config to standard output; exit code 0. A config that cannot be
    used raises ConfigError, as the run would, before anything is printed."""
    if config_path == "-":
        cfg = build_config(config_tree(sys.stdin.read(), "the config on standard input"), overrides)
    else:
        cfg = load_config(config_path, overrides)
    sys.stdout.write(config_to_yaml(cfg))
    return 0
