"""Data: prepared datasets and their checks (datasets.py), the length-bucketed sampler (sampler.py)
and its loader (loader.py), the held-out split (splits.py), conversation files (chat_files.py), their
shapes (chat.py), their rendering and loss masks (chat_template.py), benchmark prompt sets
(benchmarks.py) and tokenised training sets (prepared.py)."""
