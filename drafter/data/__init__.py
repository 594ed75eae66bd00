"""Data: prepared datasets and their checks (datasets.py), the length-bucketed sampler (sampler.py),
the held-out split (splits.py), chat formats and loss masks (chat.py), benchmark prompt sets
(benchmarks.py) and the world builders' shared stages (world.py)."""
