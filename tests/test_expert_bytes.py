"""``benchmarks/expert_bytes.py``: the bytes a rank sends for the experts and the token exchange, counted per
collective, agree with the formula (FSDP only and expert parallelism), at the benchmark's smallest size."""

from __future__ import annotations

import pytest

from benchmarks.expert_bytes import TOLERANCE, Case, compare, expert_parameters_per_layer, measure


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "case",
    [Case(2, 2, 2, 1), Case(1, 4, 4, 2)],
    ids=["2x2-fsdp-only", "1x4-expert-parallel-2"],
)
def test_counted_expert_and_all_to_all_bytes_match_the_formula(case, tmp_path):
    ranks = measure(case, steps=1, routing="uniform", timeout=200, out_dir=tmp_path)
    rows = compare(case, ranks, expert_parameters_per_layer(), "uniform")
    outside = [
        (row["rank"], row["part"], row["counted"], row["formula"]) for row in rows if abs(row["difference"]) > TOLERANCE
    ]
    assert not outside
    # every part the formula expects traffic for was counted on every rank (not a formula and a counter both at 0)
    expected = {row["part"] for row in rows if row["formula"] > 0}
    assert expected == (
        {"experts all-gather + reduce-scatter", "experts replicate all-reduce"}
        if case.expert_parallel_size == 1
        else {"experts all-gather + reduce-scatter", "token all-to-all", "count exchange"}
    )
