"""The error a user's setting causes: train.py, eval and the data tools report it in one line."""


class ConfigError(ValueError):
    """A config value, flag or file choice that cannot work, named by its key."""


def missing_local_path(path: str) -> bool:
    """Whether `path` names a local directory that does not exist. A hub id is 'name' or
    'namespace/name': more parts, or a leading '.', '/' or '~', mean a local path, which transformers
    would report as a malformed hub id rather than as missing."""
    from pathlib import Path
    local = path.count("/") > 1 or path.startswith((".", "/", "~"))
    return local and not Path(path).exists()
