"""The paper figures, drawn from finished runs (DataFrames from :mod:`hybridgen_harness.plotdata`).

Each function takes the runs and returns a matplotlib ``Figure`` (the notebooks under
``notebooks/`` save it; the tests inspect its axes, legend entries and marks). The common
marks live in :mod:`.marks`: where each number comes from (measured / emulated / projected, a
badge in every panel), error bars, "does not fit" drawn as a hatched bar with its legend entry,
and readable log ticks ("6x", not "6x10^0").
"""
