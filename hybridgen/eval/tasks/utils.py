"""Dataset loaders of the local lm-eval tasks (``custom_dataset: !function utils.X``).

lm-eval calls them with the task's ``dataset_kwargs`` plus the run's metadata; a dataset that
has not been prepared raises hybridgen.errors.MissingDataError naming `make data`.
"""
from hybridgen.eval.tasks_data import load_bigbench, load_needle, load_ppl  # noqa: F401
