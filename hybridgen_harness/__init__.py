"""The harness around the library: commands that measure, and the store of what runs produced.

The library (``hybridgen``) runs models and methods and prices them; this package holds what
only the harness needs, so the library never imports it (a test checks the direction):

- :mod:`~hybridgen_harness.profile` (+ :mod:`~hybridgen_harness.profile_host`): measure this
  machine into a hardware profile, ``python -m hybridgen_harness.profile --out FILE``;
- :mod:`hybridgen_harness.perf`: the performance model checked against measurements,
  ``python -m hybridgen_harness.perf.validate --json FILE``;
- :mod:`~hybridgen_harness.results` (run directories, atomic writes, locks) and
  :mod:`~hybridgen_harness.result_tables` (``summary.csv`` and plain-text tables), used by
  ``experiments/``, ``benchmarks/`` and the notebooks' data access
  :mod:`~hybridgen_harness.plotdata`.

It is installed with the library (``pip install -e .``) so the commands work from any directory.
"""
