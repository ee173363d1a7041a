"""The C kernels of the CPU branch (``csrc/*.c``), compiled on first use, called through ctypes.

On first use the C sources beside this module (``csrc/``, as read when this module was
imported) are compiled with the system C compiler (``$CC``, else ``cc``/``gcc``; ``-O3 -shared -fPIC``) into one shared object in
``$HYBRIDGEN_CACHE/native/`` (default ``~/.cache/hybridgen/native``), named by a hash of the
sources, the compiler's version and the machine, and loaded with ctypes, which releases the
GIL during each call: :meth:`hybridgen.attention.cpu_pool.CPUAttentionPool.run_split`
runs slices of a kernel on its threads. Nothing is downloaded; without a compiler (or with
``HYBRIDGEN_NATIVE=0``) :func:`lib` returns None and every caller takes its numba or torch
path. x86-64 builds carry AVX2+FMA and AVX-512 (VNNI) bodies picked at run time
(:func:`isa`); other CPUs run the portable C. ``HYBRIDGEN_CPU_ISA=portable|avx2|avx512``
caps the level (to compare levels on one machine).

Kernels (shapes in the sources): ``hg_scan_bf16`` / ``hg_scan_f32`` (exact scan, fp32
accumulation, ``scan_exact.c``), ``hg_scan_bf16dot`` (the selection scan: bf16-rounded query,
bf16 products, fp32 accumulation; AVX-512 BF16 ``vdpbf16ps`` where the CPU has it, else the
exact scan's bodies on the rounded query, ``scan_bf16dot.c``), ``hg_sketch_quantize`` / ``hg_sketch_scan`` (the key
sketch, ``sketch.c``), ``hg_select`` (group scoring + partial top-k + the selected logits),
``hg_rows_bf16`` (exact logits of selected rows read in place), ``hg_gather_rows`` (row
gather) (``select.c``), ``hg_branch`` (HybridGen's default CPU branch, those stages
fused per (batch, KV head) row, ``branch.c``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hybridgen.runtime import CPU_ISA_LEVELS, cpu_isa_cap

_SRC_DIR = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-shared", "-fPIC", "-fno-math-errno", "-std=gnu99"]
ISA_NAMES = CPU_ISA_LEVELS
_lock = threading.Lock()
_lib: Any = None
_tried = False
build_error: Optional[str] = None  # why the last build failed (None: built or not tried)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES = {
    "hg_isa_level": ([], ctypes.c_int),
    "hg_set_isa_limit": ([ctypes.c_int], ctypes.c_int),
    "hg_scan_bf16": ([_P, _P, _I, _P, _F, _I, _I, _I, _I, _P, _I, _I], None),
    "hg_scan_f32": ([_P, _P, _I, _P, _F, _I, _I, _I, _I, _P, _I, _I], None),
    "hg_scan_bf16dot": ([_P, _P, _I, _P, _F, _I, _I, _I, _I, _P, _I, _I], None),
    "hg_has_bf16dot": ([], ctypes.c_int),
    "hg_sketch_quantize": ([_P, _I, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I], None),
    "hg_sketch_scan": ([_P, _P, _I, _P, _I, _I, _I, _I, _P, _I, _F, _I, _I, _I, _I, _P, _I, _I], None),
    "hg_select": ([_P, _I, _I, _I, _I, _P, _P, _P, _I, _P, _I, _I], ctypes.c_int),
    "hg_rows_bf16": ([_P, _P, _I, _P, _I, _P, _F, _I, _I, _I, _I], None),
    "hg_gather_rows": ([_P, _I, _P, _I, _I, _P, _I, _I, _I], None),
    "hg_branch": ([_P, _P, _P, _P, _I, _I, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P,
                   _I, _I], ctypes.c_int),
}


def cache_dir() -> Path:
    """Where built kernels live: ``$HYBRIDGEN_CACHE/native`` (default ``~/.cache/hybridgen/native``)."""
    return Path(os.environ.get("HYBRIDGEN_CACHE") or "~/.cache/hybridgen").expanduser() / "native"


def sources() -> List[Path]:
    """The C sources compiled into the kernels' shared object (``csrc/*.c``; with ``csrc/*.h``
    they are read once, when this module is imported: see :data:`_SNAPSHOT`)."""
    return sorted(_SRC_DIR.glob("*.c"))


#: the sources as they were when this module was imported: a build compiles these, so the
#: shared object always matches the signatures above, even when the files change under a
#: running process (a long sweep while the kernels are edited)
_SNAPSHOT: Dict[str, bytes] = {p.name: p.read_bytes() for p in [*sources(), *sorted(_SRC_DIR.glob("*.h"))]}


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str, extra: Tuple[str, ...] = ()) -> Path:
    """Compile the sources (once per sources/compiler/flags/machine) and return the shared object's path."""
    flags = [*_FLAGS, *extra]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for name, text in _SNAPSHOT.items():
        digest.update(name.encode() + text)
    digest.update(version.encode() + " ".join(flags).encode() + platform.machine().encode())
    out = cache_dir() / f"hg_cpu_{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        for name, text in _SNAPSHOT.items():
            (Path(tmp) / name).write_bytes(text)
        srcs = [str(Path(tmp) / name) for name in _SNAPSHOT if name.endswith(".c")]
        res = subprocess.run([cc, *flags, "-o", str(so), *srcs, "-lm"], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
        os.replace(so, out)  # atomic: concurrent first uses agree on one file
    return out


def _load(path: Path) -> Any:
    handle = ctypes.CDLL(str(path))
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(handle, name)
        fn.argtypes, fn.restype = args, res
    return handle


def load_portable() -> Any:
    """A separate build with only the portable C bodies (``-DHG_PORTABLE``), for tests that
    compare them with the vector bodies; None without a compiler."""
    cc = _compiler()
    return _load(_build(cc, ("-DHG_PORTABLE",))) if cc else None


def lib() -> Any:
    """The loaded kernels (a ctypes.CDLL with typed functions), or None when they cannot be built."""
    global _lib, _tried, build_error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("HYBRIDGEN_NATIVE", "1").strip() in ("0", "false", "no", "off"):
            build_error = "disabled by HYBRIDGEN_NATIVE=0"
        else:
            cap = cpu_isa_cap()  # a bad value is the caller's error, not a build failure
            cc = _compiler()
            if cc is None:
                build_error = "no C compiler (set CC or install gcc)"
            else:
                try:
                    _lib = _load(_build(cc))
                    _lib.hg_set_isa_limit(cap)
                except Exception as exc:  # noqa: BLE001 - any build/load failure means "use the fallback"
                    build_error = f"{type(exc).__name__}: {exc}"
        _tried = True
    return _lib


def available() -> bool:
    """True when the C kernels are built and loaded."""
    return lib() is not None


def isa() -> int:
    """The instruction-set level the loaded kernels use: 0 portable C (or no kernels), 1 AVX2+FMA,
    2 AVX-512 with VNNI (:data:`ISA_NAMES`); the CPU's own level unless capped."""
    return int(lib().hg_isa_level()) if available() else 0


def set_isa_limit(level: int) -> int:
    """Cap the level the kernels use (tests compare the levels on one machine); returns the level
    in use afterwards (the CPU's own level when that is lower)."""
    return int(lib().hg_set_isa_limit(int(level))) if available() else 0


def has_bf16dot() -> bool:
    """True when ``hg_scan_bf16dot`` runs AVX-512 BF16 ``vdpbf16ps`` (the CPU has it and the level
    in use is avx512); else it runs the exact scan's bodies on the bf16-rounded query."""
    return bool(lib().hg_has_bf16dot()) if available() else False


def has_avx2() -> bool:
    """True when the loaded kernels run their vector (AVX2 or better) bodies on this CPU."""
    return isa() >= 1
