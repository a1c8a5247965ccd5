"""The application: what the `meshrl` command does with the library (`meshrl/`) and the
role servers (`services/`).

cli.py             `meshrl run | serve | status | stop | reward | preprocess | export | demo`
run_local.py       a run with every role server started as a local subprocess
export.py          a checkpoint's actor or critic as a Hugging Face folder
export_adapter.py  a LoRA run's adapter alone, as a peft folder
demo/              `meshrl demo`: the embedded default run on CPU
"""
