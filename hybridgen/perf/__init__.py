"""A roofline-style performance model of one decode step, on hardware profiles (PROJECTED).

Every number this package returns is a projection from datasheet or measured bandwidths,
never a measurement: each :class:`StepPrediction` carries ``projected=True`` and prints as
"projected". :func:`compare_to_measured` reports the prediction error wherever the hardware
exists.

One job per module:

- :mod:`~hybridgen.perf.profiles`: the hardware-profile schema, ``extends`` merging, loading
  and validation (``available_profiles``, ``load_profile``, ``profile_from_dict``);
- :mod:`hybridgen.shapes` (below the methods, which size their footprints with it; re-exported
  here): :class:`ModelShape` (architecture) and :class:`Workload`
  (batch, context, dtype, mapping override: what the run decides);
- :mod:`~hybridgen.perf.context`: :class:`CostContext` (shared quantities and device / host
  primitives) and :class:`LayerCost` (what a cost returns);
- :mod:`~hybridgen.perf.costs`: cost primitives with explicit arguments (GPU-resident attention,
  CPU split, PCIe stream, offloaded kept set); each method's ``layer_cost(c)`` calls one with
  its own parameters or prices itself next to its code (None = not modelled);
  HybridGen's own cost lives beside it (:mod:`hybridgen.hybrid.cost`);
- :mod:`~hybridgen.perf.host_tiers`: a method's host bytes on the profile's DRAM, then CXL, or
  "does not fit host memory" (:class:`HostTiers`, :func:`host_capacities`);
- :mod:`~hybridgen.perf.predict`: :func:`predict_step` scales a layer to the model;
- :mod:`~hybridgen.perf.compare`: projected vs measured error tables (:func:`compare_to_measured`);
- :mod:`~hybridgen_harness.perf.validate`: the model checked against measurements,
  ``python -m hybridgen_harness.perf.validate --json FILE`` (rows from :mod:`~hybridgen_harness.perf.probe_rows`,
  the H200-host probe files, and :mod:`~hybridgen_harness.perf.local_rows`, runs on this machine).

    >>> from hybridgen.methods import build_method
    >>> p = predict_step(build_method("hybridgen", topk_ratio=0.05), "llama-3.1-8b", Workload(), "h200-host")
"""
from hybridgen.perf.context import CostContext, LayerCost
from hybridgen.perf.costs import (cpu_attention_split_cost, full_cost, gpu_resident_cost, offloaded_kept_cost,
                                  stream_cost)
from hybridgen.perf.host_tiers import HostTiers, host_capacities, place_host_bytes
from hybridgen.perf.predict import NotModelled, StepPrediction, fastest_setting, predict_step
from hybridgen.perf.profiles import (PROFILE_DIR, CXLSpec, GPUSpec, HardwareProfile, HostSpec, LinkSpec, NodeSpec,
                                     available_profiles, load_profile, profile_from_dict)
from hybridgen.shapes import DTYPE_BYTES, MAPPINGS, ModelShape, Workload, as_model_shape
from hybridgen.perf.compare import ErrorRow, ErrorTable, compare_to_measured

__all__ = ["fastest_setting", 
    "CostContext", "LayerCost", "cpu_attention_split_cost", "stream_cost", "full_cost", "gpu_resident_cost",
    "offloaded_kept_cost", "HostTiers", "host_capacities", "place_host_bytes",
    "NotModelled", "StepPrediction", "predict_step", "PROFILE_DIR", "CXLSpec", "GPUSpec", "HardwareProfile",
    "HostSpec", "LinkSpec", "NodeSpec", "available_profiles", "load_profile", "profile_from_dict", "DTYPE_BYTES",
    "MAPPINGS", "ModelShape", "Workload", "as_model_shape", "ErrorRow", "ErrorTable", "compare_to_measured",
]
