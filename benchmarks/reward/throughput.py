"""Reward scoring throughput: scores/second for GSM8k and MATH responses through RewardScorer.

    python -m benchmarks.reward.throughput [--n 3000] [--workers 2]

Synthetic but realistic responses (a few sentences of reasoning, then the final answer; about
half right, MATH answers in varied but equivalent forms, all distinct), scored by the rule scorers in worker processes exactly as the server does. Prints
one JSON line and writes benchmarks/results/reward_throughput_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

from meshrl.config.sections import RewardConfig
from services.reward.scoring import RewardScorer
from services.reward.types import ScoreItem

RESULTS = Path(__file__).parents[1] / "results" / "reward_throughput_cpu.json"


def math_answer(rng: random.Random) -> tuple[str, str, str]:
    """A MATH-style final answer: (ground truth, an equivalent form, a wrong one), all
    drawn afresh so that caches don't make the figure look better than it is."""
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    kind = rng.randrange(7)
    if kind == 0:
        return str(a * b), f"{a * b}.0", str(a * b + 1)
    if kind == 1:
        return (
            f"\\frac{{{a}}}{{{b + a}}}",
            f"\\dfrac{{{2 * a}}}{{{2 * (b + a)}}}",
            f"\\frac{{{a + 1}}}{{{b + a}}}",
        )
    if kind == 2:
        return f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", f"{a + 1}\\sqrt{{{b}}}"
    if kind == 3:
        return (
            f"\\left( {a}, \\frac{{\\pi}}{{{b}}} \\right)",
            f"({a},\\frac{{\\pi}}{{{b}}})",
            f"({a}, \\pi)",
        )
    if kind == 4:
        return f"x^2+{a + b}x+{a * b}", f"(x+{a})(x+{b})", f"x^2+{a + b}x+{a * b + 1}"
    if kind == 5:
        return f"[-{a}, {b}]", f"[-{a},{b}]", f"(-{a}, {b})"
    return f"-\\frac{{{a}}}{{4}}", str(-a / 4), f"\\frac{{{a}}}{{4}}"


STEPS = [
    "First, we note that the total is the sum of the parts.",
    "Multiplying both sides by 2 gives the intermediate value.",
    "Substituting back, we find the remaining quantity.",
    "Therefore we can simplify the expression step by step.",
    "Checking the units, the result is consistent.",
]


def gsm8k_items(n: int, rng: random.Random) -> list[ScoreItem]:
    items = []
    for _ in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        truth = a * b
        said = truth if rng.random() < 0.5 else truth + rng.randint(1, 9)
        reasoning = " ".join(rng.choices(STEPS, k=rng.randint(3, 8)))
        text = f"{reasoning}\nSo {a} * {b} = <<{a}*{b}={said}>>{said:,}.\n#### {said:,}"
        items.append(ScoreItem("openai/gsm8k", text, str(truth)))
    return items


def math_items(n: int, rng: random.Random) -> list[ScoreItem]:
    items = []
    for _ in range(n):
        truth, same, wrong = math_answer(rng)
        answer = rng.choice([truth, same]) if rng.random() < 0.5 else wrong
        reasoning = " ".join(rng.choices(STEPS, k=rng.randint(3, 8)))
        text = f"{reasoning} We compute $y = {answer}$ from there.\n\nThe final answer is $\\boxed{{{answer}}}$."
        items.append(ScoreItem("DigitalLearningGmbH/MATH-lighteval", text, truth))
    return items


def workers_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children so far (Linux /proc)."""
    total, me, tick = 0.0, os.getpid(), os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def measure(scorer: RewardScorer, items: list[ScoreItem]) -> dict:
    cpu0, t0 = workers_cpu_s(), time.perf_counter()
    out = scorer.score(items)
    seconds = time.perf_counter() - t0
    cpu = workers_cpu_s() - cpu0
    return {
        "items": len(items),
        "seconds": round(seconds, 3),
        "scores_per_s": round(len(items) / seconds, 1),
        # load-independent: what one sample costs a worker core
        "worker_cpu_ms_per_item": round(1000 * cpu / len(items), 2),
        "mean_score": round(sum(o.score for o in out) / len(out), 4),
        "failed": sum(not o.ok for o in out),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=3000, help="responses per dataset")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    rng = random.Random(0)
    gsm, math = gsm8k_items(args.n, rng), math_items(args.n, rng)
    t0 = time.perf_counter()
    with RewardScorer(RewardConfig(num_workers=args.workers, timeout_s=10.0)) as scorer:
        startup = time.perf_counter() - t0
        scorer.score(gsm[:50] + math[:50])  # every worker has parsed once
        result = {
            "benchmark": "reward_throughput",
            "load_avg_1m_before": round(os.getloadavg()[0], 2),
            "workers": args.workers,
            "cpu_cores": os.cpu_count(),
            "python": platform.python_version(),
            "startup_s": round(startup, 2),
            "gsm8k": measure(scorer, gsm),
            "math": measure(scorer, math),
        }
    line = json.dumps(result)
    print(line)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
