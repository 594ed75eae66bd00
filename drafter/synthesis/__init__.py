"""Synthesis: data the target writes, which needs both the target and the data layers. Its answers to
chat data, a regeneration: answers.py runs one on a server (answer_server.py) or a local target;
regeneration.py holds the jobs, the resumable output and the batched local loop. Worlds, a target plus
the data a drafter needs, built in resumable stages (world.py); the toy world's corpus and chat task
(stdlib_corpus.py) and its tokenizer (toy_tokenizer.py)."""
