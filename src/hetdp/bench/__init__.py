"""The reproducible experiments behind ``hetdp bench NAME``, one module per experiment.

Each module exposes ``add_arguments(parser)``, ``run(args) -> dict`` (the JSON
figures) and ``render(result) -> str`` (the table). ``hetdp bench`` adds the
common ``--quick``, ``--json PATH`` and ``--seed`` flags to every one.
"""

BENCHMARKS: dict[str, str] = {}
"""Benchmark name -> one-line description; the module is ``hetdp.bench.<name>``."""
