"""Experiment harness: Hydra configs (conf/), the run entry point, sweeps, aggregation."""
