"""Training infrastructure: the engines (engine.py), checkpoints and run identity (checkpoint.py), the
distributed world (launch.py, collectives.py), the memory plan (memory_plan.py), logging and progress
(tracking.py, progress.py), run-directory locking (run_lock.py) and host-sync checks (host_sync.py)."""
