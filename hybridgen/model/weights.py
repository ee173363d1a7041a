"""Model weights: from a local HF safetensors checkpoint, seeded random init, or a cheap dummy fill.

All three sources go through one assembler that reads tensors by their Hugging Face names
and builds :class:`ModelWeights`, fusing q/k/v into one matrix and (for SwiGLU) gate/up into
another so a layer runs two large GEMMs instead of five. ``attention_weights`` style views
(wq, wk, wv) are slices of the fused matrix, not copies.

Choices (where HF or FlexGen leave room):
- random: every matrix and embedding ~ N(0, 0.02) (HF's initializer_range), norm weights 1,
  biases 0, drawn in a fixed name order from one seeded generator on the target device.
- dummy: FlexGen fills huge shapes cheaply instead of drawing random numbers. Here one block
  of P = 1,000,003 (a prime) uniform values with std 0.02 is drawn once per (seed, device,
  dtype) and tiled over each tensor's flat storage, starting at a per-tensor offset (CRC32 of
  its name). Because P is prime and larger than every row length, consecutive rows are
  distinct shifts of a random sequence: matrices are full-rank-like, layers differ, so
  attention logits are spread and top-k selections are non-degenerate; norms 1, biases 0
  keep activations finite through many layers. Filling is memory-bandwidth bound (a few
  doubling copies), not RNG bound.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.errors import ConfigError, MissingDataError
from hybridgen.model.hf_layout import hf_param_shapes, layer_names, top_names
from hybridgen.model.spec import ModelSpec

INIT_STD = 0.02
DUMMY_PERIOD = 1_000_003

# A source returns the tensor for an HF parameter name, already of `shape`, dtype and device.
# kind: 'matrix' | 'embed' | 'norm' | 'bias'
Source = Callable[[str, Tuple[int, ...], str], Tensor]


@dataclass
class LayerWeights:
    """One decoder layer. h = hidden_size, I = intermediate_size, Hq/Hkv heads of size D.

    qkv: [(Hq + 2*Hkv)*D, h] rows q, then k, then v. w_in: [2*I, h] (gate rows then up rows)
    for SwiGLU, [I, h] for a plain MLP. w_out: [h, I]. o: [h, Hq*D]. Biases may be None.
    """

    attn_norm: Tensor
    attn_norm_b: Optional[Tensor]
    qkv: Tensor
    qkv_b: Optional[Tensor]
    o: Tensor
    o_b: Optional[Tensor]
    mlp_norm: Tensor
    mlp_norm_b: Optional[Tensor]
    w_in: Tensor
    b_in: Optional[Tensor]
    w_out: Tensor
    b_out: Optional[Tensor]


@dataclass
class ModelWeights:
    """All weights. embed/lm_head: [V, E] (the same tensor when tied); pos_embed: [P + 2, h] (OPT);
    project_in: [h, E], project_out: [E, h] (OPT with word_embed_proj_dim != hidden_size)."""

    embed: Tensor
    layers: List[LayerWeights]
    lm_head: Tensor
    final_norm: Optional[Tensor] = None
    final_norm_b: Optional[Tensor] = None
    pos_embed: Optional[Tensor] = None
    project_in: Optional[Tensor] = None
    project_out: Optional[Tensor] = None

    def nbytes(self) -> int:
        """Bytes held (tied tensors counted once)."""
        seen, total = set(), 0
        tensors = [getattr(self, f.name) for f in fields(self) if f.name != "layers"]
        for layer in self.layers:
            tensors += [getattr(layer, f.name) for f in fields(layer)]
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


# ---------------------------------------------------------------------- assembly
def build_weights(spec: ModelSpec, source: Source) -> ModelWeights:
    """Assemble :class:`ModelWeights` by asking ``source`` for every HF-named tensor."""
    shapes = hf_param_shapes(spec)

    def get(name: str) -> Optional[Tensor]:
        if name not in shapes:
            return None
        shape, kind = shapes[name]
        return source(name, shape, kind)

    top = top_names(spec)
    embed = get(top["embed"] + ".weight")
    layers = []
    for i in range(spec.num_layers):
        n = layer_names(spec, i)
        q, k, v = (get(n[x] + ".weight") for x in ("q", "k", "v"))
        qkv = torch.cat([q, k, v], 0)
        del q, k, v
        qkv_b = torch.cat([get(n[x] + ".bias") for x in ("q", "k", "v")], 0) if spec.qkv_bias else None
        if spec.gated_mlp:
            w_in = torch.cat([get(n["gate"] + ".weight"), get(n["up"] + ".weight")], 0)
            b_in = torch.cat([get(n["gate"] + ".bias"), get(n["up"] + ".bias")], 0) if spec.mlp_bias else None
            w_out, b_out = get(n["down"] + ".weight"), get(n["down"] + ".bias")
        else:
            w_in, b_in = get(n["fc1"] + ".weight"), get(n["fc1"] + ".bias")
            w_out, b_out = get(n["fc2"] + ".weight"), get(n["fc2"] + ".bias")
        layers.append(LayerWeights(
            attn_norm=get(n["attn_norm"] + ".weight"), attn_norm_b=get(n["attn_norm"] + ".bias"),
            qkv=qkv, qkv_b=qkv_b, o=get(n["o"] + ".weight"), o_b=get(n["o"] + ".bias"),
            mlp_norm=get(n["mlp_norm"] + ".weight"), mlp_norm_b=get(n["mlp_norm"] + ".bias"),
            w_in=w_in, b_in=b_in, w_out=w_out, b_out=b_out))
    lm_head = embed if spec.tie_embeddings else get(top["lm_head"] + ".weight")
    return ModelWeights(
        embed=embed, layers=layers, lm_head=lm_head,
        final_norm=get(top["final_norm"] + ".weight"), final_norm_b=get(top["final_norm"] + ".bias"),
        pos_embed=get(top["pos"] + ".weight") if "pos" in top else None,
        project_in=get(top["project_in"] + ".weight") if "project_in" in top else None,
        project_out=get(top["project_out"] + ".weight") if "project_out" in top else None,
    )


# ---------------------------------------------------------------------- sources
def random_source(seed: int, dtype: torch.dtype, device: torch.device, std: float = INIT_STD) -> Source:
    """Seeded N(0, std) matrices/embeddings, norm weights 1, biases 0 (HF-style init)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def source(name: str, shape: Tuple[int, ...], kind: str) -> Tensor:
        if kind == "norm":
            return torch.ones(shape, dtype=dtype, device=device)
        if kind == "bias":
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)

    return source


def _tile_fill(out: Tensor, block: Tensor, offset: int) -> Tensor:
    """Fill ``out`` so that out.flatten()[i] = block[(i + offset) % len(block)] using doubling copies."""
    flat = out.view(-1)
    n, p = flat.numel(), block.numel()
    offset %= p
    first = min(n, p)
    head = min(first, p - offset)
    flat[:head].copy_(block[offset:offset + head])
    if first > head:
        flat[head:first].copy_(block[:first - head])
    filled = first
    while filled < n:  # flat[:filled] has period p and filled is a multiple of p
        m = min(filled, n - filled)
        flat[filled:filled + m].copy_(flat[:m])
        filled += m
    return out


def dummy_source(seed: int, dtype: torch.dtype, device: torch.device, std: float = INIT_STD) -> Source:
    """Cheap deterministic fill (see module docstring): a tiled prime-length random block."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    bound = std * 3 ** 0.5  # uniform(-a, a) has std a / sqrt(3)
    block = ((torch.rand(DUMMY_PERIOD, generator=gen) * 2 - 1) * bound).to(dtype=dtype, device=device)

    def source(name: str, shape: Tuple[int, ...], kind: str) -> Tensor:
        if kind == "norm":
            return torch.ones(shape, dtype=dtype, device=device)
        if kind == "bias":
            return torch.zeros(shape, dtype=dtype, device=device)
        out = torch.empty(shape, dtype=dtype, device=device)
        return _tile_fill(out, block, zlib.crc32(name.encode()))

    return source


# ---------------------------------------------------------------------- integrity
_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                   "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_problem(path: Path) -> Optional[str]:
    """None when ``path`` is a structurally sound safetensors file, else what is wrong.

    Checks what can be checked without reading the tensors: the 8-byte header length, a JSON
    header within the file, every tensor's byte range inside the data section and consistent
    with its shape and dtype, and a file size equal to header + data (an empty, truncated or
    overwritten file fails; flipped bytes inside tensor data do not, see the finiteness check
    of :class:`CheckpointSource`).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{path.name} is {size} bytes, too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n <= 0 or 8 + n > size:
                return f"{path.name}: header length {n} does not fit in its {size} bytes (truncated or overwritten)"
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as err:
        return f"{path.name} cannot be read ({err.strerror or err})"
    except (UnicodeDecodeError, ValueError):
        return f"{path.name}: its header is not valid JSON (overwritten or not a safetensors file)"
    if not isinstance(header, dict):
        return f"{path.name}: its header is not a JSON object"
    data_bytes, end = size - 8 - n, 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            lo, hi = (int(x) for x in info["data_offsets"])
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            width = _ST_DTYPE_BYTES.get(str(info["dtype"]))
        except (KeyError, TypeError, ValueError):
            return f"{path.name}: header entry {key!r} is malformed"
        if not 0 <= lo <= hi <= data_bytes or (width is not None and hi - lo != numel * width):
            return (f"{path.name}: tensor {key!r} needs bytes {lo}..{hi} of a {data_bytes}-byte data section "
                    "(truncated)")
        end = max(end, hi)
    if end != data_bytes:
        return f"{path.name}: {data_bytes} data bytes but its tensors end at {end} (truncated or padded)"
    return None


def checkpoint_problem(path: Path) -> Optional[str]:
    """None when ``path`` looks like a complete HF safetensors checkpoint directory, else what is wrong."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return "config.json is missing"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (OSError, ValueError):
            return "model.safetensors.index.json is not valid JSON"
        files = [path / f for f in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            return f"shard(s) {', '.join(missing[:3])} listed in model.safetensors.index.json are missing"
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return "no *.safetensors file"
    for f in files:
        problem = safetensors_problem(f)
        if problem:
            return problem
    return None


class CheckpointSource:
    """Reads tensors from a local HF checkpoint directory (single or sharded safetensors).

    Names are matched as saved by transformers ('model.layers.0...') and, for older OPT
    checkpoints, without the leading 'model.' ('decoder.layers.0...').

    A damaged file is refused with one line naming ``fix`` (default: re-download): a file that
    fails :func:`safetensors_problem`, or a floating-point tensor holding NaN or inf (flipped
    bytes; a real checkpoint never stores them, and they would make every logit NaN).
    """

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device, fix: Optional[str] = None):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self.dtype, self.device = dtype, torch.device(device)
        self.fix = fix or f"re-download the checkpoint into {self.path}"
        files = self._weight_files()
        for f in files:
            problem = safetensors_problem(f)
            if problem:
                raise MissingDataError(f"checkpoint {self.path} is damaged: {problem}; {self.fix}")
        try:
            self._handles = {f: safe_open(str(f), framework="pt", device="cpu") for f in files}
        except (SafetensorError, OSError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise MissingDataError(f"checkpoint {self.path} is damaged: {first}; {self.fix}") from None
        self._where: Dict[str, Path] = {}
        for f, h in self._handles.items():
            for key in h.keys():
                self._where[key] = f

    def _weight_files(self) -> List[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise MissingDataError(f"checkpoint {self.path} lacks shard(s) {', '.join(missing[:3])}; "
                                       "download the missing files listed in model.safetensors.index.json")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        if any(self.path.glob("*.bin")) or any(self.path.glob("*.pt")):
            raise MissingDataError(f"checkpoint {self.path} has only PyTorch .bin weights; convert it to "
                                   "safetensors (transformers: from_pretrained(...).save_pretrained(dir))")
        raise MissingDataError(f"no *.safetensors weights in {self.path}; put the checkpoint there, "
                               "or use weights='random' or 'dummy'")

    def _resolve(self, name: str) -> Optional[str]:
        for cand in (name, name[len("model."):] if name.startswith("model.") else None):
            if cand and cand in self._where:
                return cand
        return None

    def __call__(self, name: str, shape: Tuple[int, ...], kind: str) -> Tensor:
        key = self._resolve(name)
        if key is None:
            raise MissingDataError(f"checkpoint {self.path} lacks tensor {name!r}; "
                                   "it does not match its config.json (re-download the checkpoint)")
        t = self._handles[self._where[key]].get_tensor(key)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise MissingDataError(f"tensor {name!r} in {self._where[key]} holds NaN or inf values: the checkpoint "
                                   f"is damaged; {self.fix}")
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"tensor {name!r} in {self.path} has shape {tuple(t.shape)} but config.json implies "
                              f"{tuple(shape)}; config and weights do not belong together")
        return t.to(dtype=self.dtype).to(self.device)
