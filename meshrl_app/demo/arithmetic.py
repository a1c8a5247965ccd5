"""A GSM8k-format arithmetic data set: `Q: 23+58=` -> `23+58=81 #### 81`.

Written as verl-schema parquet (data_source `openai/gsm8k`), so the demo goes through the
same dataset, chat-template and GSM8k scorer paths as a real GSM8k run. `digits` sets the
size of both operands (2: 10-99, 3: 100-999).
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def operand_range(digits: int) -> tuple[int, int]:
    """The smallest and largest operand of `digits` digits."""
    if digits < 1:
        raise ValueError(f"digits must be at least 1, not {digits}")
    return (10 ** (digits - 1) if digits > 1 else 0), 10**digits - 1


def addition_problem(rng: random.Random, digits: int = 2) -> tuple[int, int]:
    lo, hi = operand_range(digits)
    return rng.randint(lo, hi), rng.randint(lo, hi)


def prompt_text(a: int, b: int) -> str:
    return f"Q: {a}+{b}="


def solution_text(a: int, b: int) -> str:
    """The target a warm start imitates: the sum, then GSM8k's `#### answer` line."""
    return f"{a}+{b}={a + b} #### {a + b}"


def parse_prompt(text: str) -> tuple[int, int]:
    """The operands of a `prompt_text`: `Q: 23+58=` -> (23, 58)."""
    a, b = text.removeprefix("Q: ").removesuffix("=").split("+")
    return int(a), int(b)


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


def distinct_problems(n: int, rng: random.Random, digits: int = 2) -> list[tuple[int, int]]:
    """`n` distinct problems in a seeded random order."""
    lo, hi = operand_range(digits)
    count = (hi - lo + 1) ** 2
    if n > count:
        raise ValueError(f"{n} problems asked, only {count} of {digits} digits exist")
    if count <= 100_000:  # small: shuffle them all (the two-digit set's order as before)
        every = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        rng.shuffle(every)
        return every[:n]
    seen: dict[tuple[int, int], None] = {}
    while len(seen) < n:
        seen.setdefault(addition_problem(rng, digits))
    return list(seen)


def write_arithmetic_parquet(
    out_dir: Path, n_train: int = 4096, n_val: int = 128, seed: int = 0, digits: int = 2
) -> dict[str, Path]:
    """Disjoint train/test problems (no validation problem is a training one); returns the
    two parquet paths."""
    problems = distinct_problems(n_val + n_train, random.Random(seed), digits)
    val, train = problems[:n_val], problems[n_val:]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, pairs in (("train", train), ("test", val)):
        path = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows(pairs, split)), path)
        paths[split] = path
    return paths


def read_problems(path: Path) -> set[tuple[int, int]]:
    """The problems of a parquet written by `write_arithmetic_parquet`."""
    return {
        parse_prompt(turn["content"])
        for prompt in pq.read_table(path).column("prompt").to_pylist()
        for turn in prompt
    }
