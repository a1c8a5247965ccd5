"""A GSM8k-format arithmetic data set: `Q: 23+58=` -> `23+58=81 #### 81`.

Written as verl-schema parquet (data_source `openai/gsm8k`), so the demo goes through the
same dataset, chat-template and GSM8k scorer paths as a real GSM8k run.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def addition_problem(rng: random.Random) -> tuple[int, int]:
    return rng.randint(10, 99), rng.randint(10, 99)


def prompt_text(a: int, b: int) -> str:
    return f"Q: {a}+{b}="


def solution_text(a: int, b: int) -> str:
    """The target a warm start imitates: the sum, then GSM8k's `#### answer` line."""
    return f"{a}+{b}={a + b} #### {a + b}"


def rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": prompt_text(a, b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "answer": solution_text(a, b)},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def write_arithmetic_parquet(
    out_dir: Path, n_train: int = 4096, n_val: int = 128, seed: int = 0
) -> dict[str, Path]:
    """Disjoint train/test problems; returns the two parquet paths."""
    rng = random.Random(seed)
    every = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(every)
    val, train = every[:n_val], every[n_val : n_val + n_train]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, pairs in (("train", train), ("test", val)):
        path = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows(pairs, split)), path)
        paths[split] = path
    return paths
