"""Nested dicts as one level (a config's keys for the run identity, the DeepSpeed JSON's "auto"
values, metrics for W&B)."""


def flatten(tree: dict, sep: str = ".", prefix: str = "") -> dict:
    """Nested dicts as one level, keys joined by `sep` (`a.b`); an empty dict stays a value."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, sep, f"{prefix}{key}{sep}"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
