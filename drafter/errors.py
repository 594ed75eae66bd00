"""The error a user's setting causes: train.py, eval and the data tools report it in one line."""


class ConfigError(ValueError):
    """A config value, flag or file choice that cannot work, named by its key."""
