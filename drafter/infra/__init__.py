"""The machinery under a run, knowing no model, loss or dataset: the engines (engine.py the
interface, deepspeed_engine.py, fsdp_engine.py, engine_choice.py which one), the
distributed world (launch.py, collectives.py), progress bars and stage timers (progress.py),
run-directory locking (run_lock.py), host-sync checks (host_sync.py) and memory sizes and the
error of a memory plan that cannot fit (memory.py), whether this CPU runs bf16 fast (cpu_dtype.py), the
weight layout it serves fastest (cpu_layout.py), a call's wall time (timing.py) and
the repository's own files found from any working directory (repo_paths.py)."""
