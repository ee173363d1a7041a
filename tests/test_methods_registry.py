"""The registry: methods come from the ``hybridgen.methods`` entry points, including other packages'."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridgen.errors import ConfigError
from hybridgen.methods import available_methods, build_method, method_class, register
from hybridgen.methods import registry

ROOT = Path(__file__).resolve().parents[1]
BUILTINS = {"full", "hybrid-exact", "hybridgen", "flexgen", "infinigen", "h2o", "snapkv", "streamingllm", "quest"}

METHOD_FILE = '''
"""A throwaway method living outside the repository: dense attention over the last `keep` tokens."""
from dataclasses import dataclass
from typing import ClassVar

from hybridgen.attention import partial_attention
from hybridgen.kv import KVSegment
from hybridgen.methods import KVMethod, PositiveInt


@dataclass
class LastTokens(KVMethod):
    name: ClassVar[str] = "{name}"
    keep: PositiveInt = 1000000

    def bind(self, ctx):
        super().bind(ctx)
        self.seg = [None] * ctx.num_layers

    def prefill(self, layer, q, k, v, valid):
        c = self.ctx
        self.seg[layer] = KVSegment(c.store["gpu"], k.shape[0], c.num_kv_heads, c.head_dim, k.dtype,
                                    f"layer{{layer}}/kv", capacity=c.max_len, with_mask=valid is not None)
        self.seg[layer].append(k, v, valid)

    def decode(self, layer, q, k, v):
        s = self.seg[layer]
        s.append(k, v)
        n = min(self.keep, s.length)
        mask = None if s.mask is None else s.mask[..., -n:]
        return partial_attention(q, s.k[..., -n:, :], s.v[..., -n:, :], self.ctx.scale, mask)[0]

    def release(self):
        for s in self.seg:
            if s is not None:
                s.release()
'''


def make_outside_package(root: Path, name: str) -> Path:
    """A package with one method file and one entry point, installed only by being on sys.path."""
    pkg = root / "outside_methods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "last_tokens.py").write_text(METHOD_FILE.format(name=name))
    dist = root / "outside_methods-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-methods\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[hybridgen.methods]\n{name} = outside_methods.last_tokens:LastTokens\n")
    return root


@pytest.fixture
def outside(tmp_path, monkeypatch):
    name = "last-tokens"
    make_outside_package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, tmp_path
    registry._loaded.pop(name, None)
    registry._declared.pop(name, None)
    sys.modules.pop("outside_methods.last_tokens", None)
    sys.modules.pop("outside_methods", None)


def test_builtins_are_entry_points_and_the_library_never_imports_baselines():
    assert BUILTINS <= set(available_methods())
    assert method_class("h2o").__module__ == "baselines.h2o"
    assert method_class("full").__module__ == "hybridgen.methods.full"
    out = subprocess.run(["grep", "-rnE", r"^\s*(import|from) baselines", str(ROOT / "hybridgen")],
                         capture_output=True, text=True)
    assert out.stdout == "", out.stdout


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ConfigError, match="choose one of: .*h2o"):
        build_method("h20")


def test_a_method_from_another_package_runs_like_a_builtin(outside):
    import torch

    from hybridgen.testing import drive

    name, _ = outside
    assert name in available_methods()
    m = build_method(name, keep="4096")
    assert m.keep == 4096 and type(m).name == name
    with pytest.raises(ConfigError, match=f"method '{name}': parameter 'keep'"):
        build_method(name, keep=0)
    # with every token kept it is dense attention: equal to `full` on the same inputs
    got = drive(m, (2, 4, 2, 16, 11), steps=3, seed=1)
    ref = drive(build_method("full"), (2, 4, 2, 16, 11), steps=3, seed=1)
    assert len(got.records) == len(ref.records) > 0
    for a, b in zip(got.records, ref.records):
        assert torch.allclose(a.out, b.out, atol=1e-6)


def test_entry_point_name_and_class_name_must_agree(tmp_path, monkeypatch):
    make_outside_package(tmp_path, "mismatch")
    (tmp_path / "outside_methods-0.1.dist-info" / "entry_points.txt").write_text(
        "[hybridgen.methods]\nother-name = outside_methods.last_tokens:LastTokens\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="calls itself 'mismatch'"):
            build_method("other-name")
    finally:
        registry._declared.pop("other-name", None)
        sys.modules.pop("outside_methods.last_tokens", None)
        sys.modules.pop("outside_methods", None)


def test_in_process_registration():
    from hybridgen.methods.full import Full

    @register("full-copy-for-test")
    class FullCopy(Full):
        pass

    try:
        assert "full-copy-for-test" in available_methods()
        assert isinstance(build_method("full-copy-for-test"), FullCopy)
    finally:
        registry._loaded.pop("full-copy-for-test")


def test_outside_method_through_the_experiment_runner(outside, tmp_path):
    """`experiments/run.py method.name=NAME` with no YAML file, with a hardware profile: it runs and
    its projected columns say "not modelled" (it declares no performance-model cost)."""
    name, pkg_root = outside
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg_root), str(ROOT)])}
    cmd = [sys.executable, str(ROOT / "experiments" / "run.py"), f"method.name={name}", "method.params.keep=64",
           "model=tiny-random", "workload=random", "workload.prompt_len=24", "workload.gen_len=3",
           "hardware=h200", "hardware.gpu_capacity=null", "hardware.dram_capacity=null", "hardware.cxl_capacity=null",
           f"results_dir={tmp_path / 'results'}", "progress=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert name in out.stdout and "not modelled" in out.stdout, out.stdout
