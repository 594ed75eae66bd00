"""The errors a user's setting causes: train.py, eval and the data tools report them in one line."""
from pathlib import Path


class UserError(Exception):
    """What a user's choice of config, data or launch causes, rather than a bug: reported as one line,
    without a traceback. Every such error of the library is one (ConfigError, DataError, ...)."""


class ConfigError(UserError, ValueError):
    """A config value, flag or file choice that cannot work, named by its key."""


def model_path_problem(path: str) -> str | None:
    """Why `path`, a model directory or hub id, cannot be loaded as a local directory, or None. A hub id
    is 'name' or 'namespace/name': more parts, or a leading '.', '/' or '~', mean a local path, which
    transformers would report as a malformed hub id rather than as missing (nor does it expand '~')."""
    if path.startswith("~"):
        return "a leading '~' is not expanded here: give the path without it"
    if not (path.count("/") > 1 or path.startswith((".", "/"))):
        return None  # a hub id, or a directory in the working directory: transformers says which
    if not Path(path).exists():
        return "no such directory"
    return None if Path(path).is_dir() else "not a directory"
