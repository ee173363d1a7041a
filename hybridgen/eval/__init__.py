"""Evaluation: measured generation and teacher-forced scoring (generation.py), fidelity to `full`
(fidelity.py), the lm-eval model `hybridgen` (lm_eval_model.py, lm_eval_cli.py), local task YAMLs
(tasks/) and their loaders (tasks_data.py), peak memory, environment capture, plot data access."""
