"""The performance model's validation: ``python -m hybridgen_harness.perf.validate --json FILE``.

:mod:`~hybridgen_harness.perf.probe_rows` prices the H200-host probe files,
:mod:`~hybridgen_harness.perf.local_rows` measures this machine in the same process, and
:mod:`~hybridgen_harness.perf.validate` tabulates predicted vs measured (the model itself is
:mod:`hybridgen.perf`).
"""
