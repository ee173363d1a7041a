"""Packaging that pyproject.toml cannot declare: the harness's configs and notebooks in the wheel.

Everything else, the package data included, is in pyproject.toml. ``conf/`` and ``notebooks/`` stay at the top of the
checkout (where the docs, the tests, ``--config-dir`` and other branches name them); the wheel
maps them into the ``experiments`` package as ``experiments/conf/`` and
``experiments/notebooks/`` (experiments/locations.py finds either place), so an installed,
non-editable copy runs ``hybridgen run +exp=quickstart`` from any directory.
"""
from setuptools import find_namespace_packages, setup

MAPPED = {"experiments.conf": "conf", "experiments.notebooks": "notebooks"}

setup(
    packages=find_namespace_packages(include=["hybridgen*", "baselines*", "hydra_plugins*", "experiments"],
                                     exclude=["*.egg-info"]) + sorted(MAPPED),
    package_dir=MAPPED,  # their package data: pyproject.toml's [tool.setuptools.package-data]
)
