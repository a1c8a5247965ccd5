"""verl's entry point, spelled as verl spells it: ``python -m meshrl_app.main_ppo key=value
...`` is ``meshrl run key=value ...``, so a verl command line (``python3 -m
verl.trainer.main_ppo data.train_files=... trainer.logger=console ...``) runs with only the
module's name changed. The settings are read as ``meshrl run`` reads them: verl's keys
where they mean the same, and a one-line error naming each key that does not."""

from __future__ import annotations

import sys

from meshrl_app.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
