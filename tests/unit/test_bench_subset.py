"""`hetdp bench subset`'s figures from rows as its workers write them (the launch itself is a benchmark's)."""

from hetdp.bench import subset


def _rows(seconds, shares, sat_out=()):
    return [{"epoch": i, "epoch_s": s, "shares": shares, "sat_out": {str(r): "why" for r in sat_out}}
            for i, s in enumerate(seconds)]


def test_the_figures_are_the_fastest_alone_over_the_group_and_the_efficiency_as_bench_allocation_defines_it():
    raw = {"parameters": {"mlp": 10, "convnet": 5}, "comm_heavy_sample_cost_ms": 20.0, "runs": {
        "fastest_alone": _rows([2.0, 1.0, 1.0, 1.0], [128]),
        "comm_heavy": _rows([3.0, 2.0, 1.0, 1.0], [128, 0, 0, 0], sat_out=(1, 2, 3)),
        "balanced_equal": _rows([4.0, 4.0, 4.0, 4.0], [32, 32, 32, 32]),
        "balanced_adaptive": _rows([3.0, 2.5, 2.0, 2.0], [16, 16, 32, 64])}}
    result = subset.summarize(raw)
    assert result["vs_fastest_alone"] == 1.0  # steady epochs: the second half
    assert result["balanced_efficiency"] == 4.0 / 2.0 / 2.0  # ideal speedup of 1,1,2,4 over equal shares: 2
    assert result["settings"]["comm_heavy"]["sat_out"] == [1, 2, 3]
    assert result["settings"]["balanced"]["sat_out"] == []
    text = subset.render({**result, "benchmark": "subset"})
    assert "vs_fastest_alone 1.000" in text and "balanced_efficiency 1.000" in text
