"""Rule scorers, one file per dataset family, and the registry mapping data_source -> scorer.

Every scorer is ``compute_score(solution_str, ground_truth, extra_info=None) -> float``. They
run inside worker processes (see ``services/reward/pool.py``), never in the server process.
"""
