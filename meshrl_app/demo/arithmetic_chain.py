"""An arithmetic dialogue data set for the ``arithmetic_chain`` environment: the prompt asks
a sum (`Q: 23+58=`), and the environment then asks about each previous result in turn
("Now add 7." / "Now subtract 4."), one question a turn.

Rows are verl-schema parquet (data_source ``openai/gsm8k``: the last answer, written
``#### N``, is the row's ground truth and the GSM8k rule scorer scores it); the
environment's script is ``extra_info.interaction_kwargs`` (``answers``, ``questions``), as
verl's interaction rows carry theirs, with ``agent_name`` naming the loop.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from meshrl_app.demo.arithmetic import prompt_text


def chain(rng: random.Random, turns: int) -> tuple[str, list[int], list[str]]:
    """A prompt, the answer expected after each of ``turns`` turns, and the questions the
    environment asks after each turn but the last."""
    a, b = rng.randint(10, 49), rng.randint(10, 49)
    answers, questions = [a + b], []
    for _ in range(turns - 1):
        step = rng.randint(1, 9)
        if rng.random() < 0.5:
            questions.append(f"Now add {step}.")
            answers.append(answers[-1] + step)
        else:
            questions.append(f"Now subtract {step}.")
            answers.append(answers[-1] - step)
    return prompt_text(a, b), answers, questions


def chain_rows(n: int, split: str, seed: int = 0, turns: int = 3) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt, answers, questions = chain(rng, turns)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "agent_name": "arithmetic_chain",
                "prompt": [{"role": "user", "content": prompt}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answers[-1])},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "interaction_kwargs": {
                        "name": "arithmetic_chain",
                        "answers": answers,
                        "questions": questions,
                    },
                },
            }
        )
    return rows


def write_arithmetic_chain_parquet(
    out_dir: Path, n_train: int = 256, n_val: int = 32, seed: int = 0, turns: int = 3
) -> dict[str, Path]:
    """train.parquet and test.parquet of ``turns``-turn dialogues; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n, s in (("train", n_train, seed), ("test", n_val, seed + 1)):
        path = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(chain_rows(n, split, s, turns)), path)
        paths[split] = path
    return paths
