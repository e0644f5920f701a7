"""Build and load the C kernels under strategies/ (`CKernel`), and call the contiguous one.

Each kernel is one C file compiled on first use with the host's C compiler for the host's own
instruction set (`-march=native`) and kept in a cache folder keyed by the source, the compiler, the
flags and the CPU, so later processes load it in milliseconds and a different CPU never loads a binary
built for another. Where it cannot be built (no compiler, a compile error) `CKernel.unavailable()`
says why, and the strategy that uses it runs another kernel under that kernel's name (`backend=auto`)
or records the point as skipped (the C backend asked for by name).

torch is imported before a library is loaded: the kernel's OpenMP calls then bind to the libgomp
torch already loaded (same soname, libgomp.so.1, in torch's CPU wheels), so its parallel loop runs on
torch's thread pool instead of a second pool competing with torch's for the same cores. Where a
second OpenMP runtime gets loaded anyway (another compiler's, another torch build's), the kernel is
declared unavailable with that reason.

This module's own kernel is `cpu_decode_attention.c`, the decode attention `contiguous` uses in fp32.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c")
# Linked in a step of its own, without -ffast-math: with it, gcc links crtfastmath.o, whose constructor
# sets flush-to-zero and denormals-are-zero for the whole process when the library loads, and every
# torch op after that (weights, references, other strategies' points) would compute differently.
LINK_FLAGS = ("-shared", "-fopenmp")
CACHE_ENV = "HARNESS_KERNEL_CACHE"  # overrides the folder the compiled kernels are kept in
POINTER, SIZE = ctypes.c_void_p, ctypes.c_int64
STRIDES = ctypes.POINTER(ctypes.c_int64)


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "decode-harness"


def _cpu_identity() -> str:
    """Model name and instruction-set flags: what -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = ("model name", "flags")
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(wanted)))


def _compiler_version(compiler: list[str]) -> str:
    try:
        return subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def _run(command: list[str], compiler: str, source: Path) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        first_error = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip())
        raise RuntimeError(f"{compiler} could not build {source.name}: {first_error[:200]}")


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    names = ("libgomp", "libomp", "libiomp")
    return {line.split()[-1] for line in maps if any(name in line.rsplit("/", 1)[-1] for name in names)}


class CKernel:
    """One C source under strategies/, compiled on first use, with the argument types of its functions."""

    def __init__(self, source_name: str, signatures: dict[str, list]):
        self.source = Path(__file__).with_name(source_name)  # the .c file, shipped as package data
        self.signatures = signatures  # exported function -> ctypes argument types (all return void)
        self.name = f"{source_name} (fp32, OpenMP)"  # how rows name it

    def headers(self) -> list[Path]:
        """The headers of strategies/ the source includes (`#include "name.h"`): part of the build's key."""
        included = re.findall(r'^#include "([^"]+)"', self.source.read_text(), flags=re.MULTILINE)
        return [self.source.with_name(name) for name in included]

    def build(self, compiler: str) -> Path:
        """The compiled library, built now unless a build for this source, compiler, flags and CPU exists."""
        command = shlex.split(compiler)  # CC may carry a wrapper: "ccache gcc"
        identity = [self.source.read_bytes().decode(), *(header.read_text() for header in self.headers()), compiler,
                    _compiler_version(command), *COMPILE_FLAGS, *LINK_FLAGS, _cpu_identity()]
        key = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]
        target = cache_dir() / f"{self.source.stem}-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built under names of their own and renamed: concurrent point processes never load half a file.
        temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        object_file = temporary.with_name(temporary.name + ".o")
        try:
            _run([*command, *COMPILE_FLAGS, str(self.source), "-o", str(object_file)], compiler, self.source)
            _run([*command, *LINK_FLAGS, str(object_file), "-o", str(temporary), "-lm"], compiler, self.source)
            os.replace(temporary, target)
        finally:
            object_file.unlink(missing_ok=True)
            temporary.unlink(missing_ok=True)
        return target

    @functools.cached_property
    def _loaded(self) -> ctypes.CDLL | str:
        """The loaded library, or the reason it cannot be had (once per process)."""
        compiler = os.environ.get("CC", "gcc")
        if not compiler.strip() or shutil.which(shlex.split(compiler)[0]) is None:
            return f"no C compiler ({compiler}) on PATH to build {self.source.name}"
        try:
            library = ctypes.CDLL(str(self.build(compiler)))
        except (RuntimeError, OSError) as error:
            return str(error)
        runtimes = _openmp_runtimes()
        if len(runtimes) > 1:  # e.g. a clang build pulling in libomp beside torch's libgomp
            return (f"{self.source.name} loaded a second OpenMP runtime ({', '.join(sorted(runtimes))}): its "
                    "threads would compete with torch's for the cores; build it with the compiler torch's "
                    "runtime matches (gcc)")
        for function, argtypes in self.signatures.items():
            getattr(library, function).argtypes = argtypes
            getattr(library, function).restype = None
        return library

    def library(self) -> ctypes.CDLL:
        """The loaded library; call `unavailable` first."""
        loaded = self._loaded
        if isinstance(loaded, str):
            raise RuntimeError(loaded)
        return loaded

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why the kernel cannot run for this device and dtype, or None when it can."""
        if device.type != "cpu":
            return f"{self.source.name} is a CPU kernel; this point runs on {device.type}"
        if dtype != torch.float32:
            return f"{self.source.name} is written for float32; dtype is {str(dtype).removeprefix('torch.')}"
        loaded = self._loaded
        return loaded if isinstance(loaded, str) else None


MAX_GROUP, MAX_DIM = 32, 512  # the contiguous kernel's limits (MAX_GROUP, MAX_DIM in its C source)
CONTIGUOUS_KERNEL = CKernel("cpu_decode_attention.c", {
    # q, k, k_strides, v, v_strides, out, batch, n_kv, group, length, visible, dim, scale, threads
    "decode_attention": [POINTER, POINTER, STRIDES, POINTER, STRIDES, POINTER, SIZE, SIZE, SIZE, SIZE, SIZE, SIZE,
                         ctypes.c_float, ctypes.c_int],
})
KERNEL_NAME = CONTIGUOUS_KERNEL.name
SOURCE = CONTIGUOUS_KERNEL.source


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the contiguous kernel cannot run for this device and dtype, or None when it can."""
    return CONTIGUOUS_KERNEL.unavailable(device, dtype)


def shape_unsupported(group: int, head_dim: int) -> str | None:
    """Why the kernel cannot take `group` query heads per KV head of width `head_dim`, or None."""
    if group > MAX_GROUP or head_dim > MAX_DIM:
        return (f"{SOURCE.name} takes at most {MAX_GROUP} query heads per KV head and head_dim {MAX_DIM}; "
                f"this model has {group} and {head_dim}")
    return None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """q [B, n_kv, G, D]; k, v [B, n_kv, S, D] cache tables (rows 0..length-1 are read) -> [B, n_kv, G, D].

    Softmax(q k^T / sqrt(D)) v for one query position per sequence; the caller has checked
    `unavailable` and `shape_unsupported`. Eager calls go straight to the library; under torch.compile
    the call is the custom op `harness::decode_attention`, which the graph keeps as one opaque kernel
    (dynamo cannot trace a ctypes call, and a graph break would run the step eager in pieces).
    """
    return masked_decode_attention(q, k, v, length, visible=length)


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                 visible: int | None = None) -> torch.Tensor:
    """The kernel on a layer's own layout: q [B, 1, H, D] (query head h = kv * G + g, as in
    strategies.attention.grouped_attention) -> [B, 1, H, D]; rows visible.. weighted 0 (None: none)."""
    batch, _, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    grouped = q.reshape(batch, n_kv, n_heads // n_kv, head_dim)  # [B, n_kv, G, D]
    out = masked_decode_attention(grouped, k, v, length, visible=length if visible is None else visible)
    return out.view(batch, 1, n_heads, head_dim)


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                            visible: int) -> torch.Tensor:
    """`decode_attention` reading rows 0..length-1 of k and v, of which rows visible.. get weight 0.

    The masked rows are still read and multiplied (by an exact 0): what attention over a whole
    preallocated table under a mask costs, as `static_full` measures.
    """
    if torch.compiler.is_compiling():
        return torch.ops.harness.decode_attention(q, k, v, length, visible)
    return _decode_attention(q, k, v, length, visible)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, visible: int) -> torch.Tensor:
    library = CONTIGUOUS_KERNEL.library()
    batch, n_kv, group, head_dim = q.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("cache rows must be contiguous")
    q = q.contiguous()
    out = torch.empty_like(q)  # [B, n_kv, G, D]
    strides = ctypes.c_int64 * 3
    library.decode_attention(
        q.data_ptr(), k.data_ptr(), strides(*k.stride()[:3]), v.data_ptr(), strides(*v.stride()[:3]), out.data_ptr(),
        batch, n_kv, group, length, visible, head_dim, head_dim**-0.5, torch.get_num_threads(),
    )
    return out


# The op torch.compile sees (registered through torch.library.Library: a dispatch per call, not
# custom_op's Python wrapper). It reads k and v and writes only its output.
_LIBRARY = torch.library.Library("harness", "FRAGMENT")
_LIBRARY.define("decode_attention(Tensor q, Tensor k, Tensor v, SymInt length, SymInt visible) -> Tensor")
_LIBRARY.impl("decode_attention", _decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("harness::decode_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, visible: int) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, n_kv, G, D], contiguous
