"""HybridGen harness: CPU-GPU collaborative attention over a tiered KV cache."""


def _version() -> str:
    """The version, stated once in pyproject.toml.

    A source checkout reads its own pyproject (installed metadata may be stale: an editable
    install of an older commit); an installed copy reads its package metadata.
    """
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.is_file():
        try:
            import tomllib
        except ImportError:  # Python 3.10: fall through to the metadata
            tomllib = None
        if tomllib is not None:
            with open(pyproject, "rb") as fh:
                project = tomllib.load(fh).get("project", {})
            if project.get("name") == "hybridgen" and project.get("version"):
                return str(project["version"])
    from importlib import metadata

    try:
        return metadata.version("hybridgen")
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
