"""Serving, exactly as it is measured (the tree itself is drafter/tree/): the one decode loop for
ar / dflash / ddtree (decode.py), ddtree on hybrid targets as a batch of paths and its memory
(path_verify.py, path_memory.py), served tau replayed and generated during training (served.py), the
public `dflash` loop compared step by step (public_loop.py), losslessness verdicts (lossless.py), an
evaluation's figures (eval_report.py) and stand-in drafters for checking the loop (testing.py)."""
