"""A training run: its config with the registries' names checked (run_config.py), its setup before the
loop: data, resume decision, target, drafter, engine (run_setup.py), the training step's loss and
metrics (objective.py, metrics.py; blocks are drafter/models/blocks.py, the losses drafter/losses/), the
attention kernel checked against dense before the first step (attention_check.py),
checkpoints, run identity and resume decisions (checkpoint.py), the memory plan (memory_plan.py) and
logging (tracking.py)."""
