"""Build and load the project's C kernels (`CKernel`): the attention reads under strategies/ and the
model's small-batch linear (harness/model/cpu_gemv.c).

Each kernel is one C file compiled on first use with the host's C compiler for the host's own
instruction set (`-march=native`) and kept in a cache folder keyed by the source, its headers, the
compiler, the flags and the CPU, so later processes load it in milliseconds and a different CPU never
loads a binary built for another. Where it cannot be built (no compiler, a compile error)
`CKernel.unavailable()` says why, and its caller runs another kernel under that kernel's name
(`auto`) or records the point as skipped (the C kernel asked for by name).

torch is imported before a library is loaded: the kernel's OpenMP calls then bind to the libgomp
torch already loaded (same soname, libgomp.so.1, in torch's CPU wheels), so its parallel loop runs on
torch's thread pool instead of a second pool competing with torch's for the same cores. Where a
second OpenMP runtime gets loaded anyway (another compiler's, another torch build's), the kernel is
declared unavailable with that reason.
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
INCLUDE_DIR = Path(__file__).parent  # vector.h, the vector type every kernel shares (on the -I path)
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
    """One C source, compiled on first use, with the argument types of its functions."""

    def __init__(self, source: Path, signatures: dict[str, list]):
        self.source = source  # the .c file, shipped as package data beside the module that calls it
        self.signatures = signatures  # exported function -> ctypes argument types (all return void)
        self.name = f"{source.name} (fp32, OpenMP)"  # how rows name it

    def headers(self) -> list[Path]:
        """Every header the source includes (`#include "name.h"`), directly or through another, found
        beside the source or in harness/kernels/ as the compiler finds them: part of the build's key."""
        found: list[Path] = []
        pending = [self.source]
        while pending:
            text = pending.pop().read_text()
            for name in re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE):
                header = next((folder / name for folder in (self.source.parent, INCLUDE_DIR)
                               if (folder / name).exists()), self.source.with_name(name))
                if header not in found:
                    found.append(header)
                    pending.append(header)
        return found

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
            _run([*command, *COMPILE_FLAGS, "-I", str(INCLUDE_DIR), str(self.source), "-o", str(object_file)], compiler,
                 self.source)
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
