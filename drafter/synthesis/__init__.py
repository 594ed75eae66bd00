"""Synthesis: data the target writes, which needs both the target and the data layers: its answers to
chat data (answers.py: a regeneration run, the local target backend) and worlds, a target plus the data
a drafter needs, built in resumable stages (world.py); the toy world's corpus and chat task
(stdlib_corpus.py) and its tokenizer (toy_tokenizer.py)."""
