"""Files a user names the way the README writes them (`--cfg v3.yaml`, `train.ds_config=ds_configs/zero3.json`),
found from any working directory: a SLURM script that cds to scratch still finds the repo's configs.

    find_in_repo("v3.yaml", "configs", "--cfg v3.yaml")  # -> /repo/configs/v3.yaml, from anywhere
"""
import os
from pathlib import Path

import drafter
from drafter.errors import ConfigError

# The directory holding train.py, configs/ and ds_configs/: the library package's parent (resolved, so
# that a symlinked checkout or a relative sys.path entry names the real directory).
REPO = Path(drafter.__file__).resolve().parents[1]


def repo_candidates(path: str, folder: str) -> list[Path]:
    """Where `path` is looked for, in order: as given (against the working directory), under the repo's
    `folder`, under the repo root. An absolute path is only itself. No duplicates (run from the repo
    root, the first and the last are one)."""
    given = Path(os.path.abspath(path))
    if Path(path).is_absolute():
        return [given]
    return list(dict.fromkeys([given, REPO / folder / path, REPO / path]))


def find_in_repo(path: str, folder: str, label: str) -> Path:
    """The first of `repo_candidates` that is a file, as an absolute path. Raises ConfigError, one line
    starting with `label` (the flag or key as the user wrote it), naming every path tried and the
    working directory: a path that resolves somewhere unexpected is then plain to see."""
    candidates = repo_candidates(path, folder)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{label}: not found; tried {', '.join(map(str, candidates))} "
                      f"(working directory {os.getcwd()})")
