"""Build and load the project's CPU kernels: one torch C++ extension whose operators are
`torch.ops.harness_kernels.*` (the attention reads of the caching strategies, the model's small-batch
linear and its decoder block in two calls; schemas in csrc/ops.cpp).

The sources are the files under harness/kernels/csrc/: one C++ translation unit per kernel, plain C
that includes no torch header (kernels.h declares them and holds the constants they share), and
ops.cpp, which registers each as an operator with TORCH_LIBRARY, a CPU implementation and a Meta one
for torch.compile's fake tensors. Eager code and compiled graphs call the same operators; Python
reads the constants from the extension (`constants`), never a copy.

Built on first use by torch.utils.cpp_extension (ninja, `$CXX`, else `c++`) for the host's own
instruction set (`-march=native`) and kept in a cache folder keyed by every file under csrc/, the
compiler and its version, the flags, the CPU, torch and Python, so later processes load the library
in milliseconds and a different CPU never loads a binary built for another. The cache
(harness.kernels.cache) stamps a build once it is complete and checks the library against its stamp
before loading it: a truncated or corrupted build is built again, never loaded; one process builds a
key at a time, the others wait for it. Where it cannot be built or loaded (no compiler, no ninja, a
compile error, a cache folder it cannot use) `unavailable` says why in one line, and its caller runs
another kernel under that kernel's name (`auto`) or records the point as skipped (the kernel asked
for by name). Nothing is built or loaded before a caller asks: a run whose kernels are all torch's
never touches the cache.

torch is imported before the library is loaded: its OpenMP calls then bind to the libgomp torch
already loaded (same soname, libgomp.so.1, in torch's CPU wheels), so its parallel regions run on
torch's thread pool instead of a second pool competing for the same cores. Where a second OpenMP
runtime gets loaded anyway (another compiler's), the kernels are declared unavailable with that reason.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from harness.kernels import cache

NAMESPACE = "harness_kernels"  # the operators' namespace, and the library's name
SOURCE_DIR = Path(__file__).with_name("csrc")  # every source and header of the extension
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
# Linked without -ffast-math: with it, gcc links crtfastmath.o, whose constructor sets flush-to-zero
# and denormals-are-zero for the whole process when the library loads, and every torch op after that
# (weights, references, other strategies' points) would compute differently.
LINK_FLAGS = ("-fopenmp",)
CACHE_ENV = "HARNESS_KERNEL_CACHE"  # overrides the folder the built extension is kept in
LIBRARY = f"{NAMESPACE}.so"  # the built library's file name in its build folder


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "decode-harness"


def compiler() -> str:
    """The C++ compiler the build uses: `$CXX` (torch.utils.cpp_extension reads it too), else `c++`."""
    return os.environ.get("CXX", "c++")


def sources() -> list[Path]:
    """The translation units: every .c and .cpp file under csrc/ (the .c files are built as C++)."""
    return sorted(path for path in SOURCE_DIR.iterdir() if path.suffix in (".c", ".cpp"))


def _cpu_identity() -> str:
    """Model name and instruction-set flags: what -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = ("model name", "flags")
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(wanted)))


def _compiler_version(command: list[str]) -> str:
    try:
        return subprocess.run([*command, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def build_key(cxx: str, source_dir: Path = SOURCE_DIR) -> str:
    """What a build depends on, hashed: every file under source_dir (name and text), the compiler and
    its version, the flags, the CPU, torch's and Python's versions."""
    files = sorted(path for path in source_dir.iterdir() if path.is_file())
    identity = [*(f"{path.name}\n{path.read_text()}" for path in files), cxx, _compiler_version(shlex.split(cxx)),
                *COMPILE_FLAGS, *LINK_FLAGS, _cpu_identity(), torch.__version__, sys.version]
    return hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]


def _first_error(error: BaseException) -> str:
    text = str(error)
    if isinstance(error, subprocess.CalledProcessError) and error.output:
        text = error.output.decode(errors="replace") if isinstance(error.output, bytes) else str(error.output)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # A compiler's own diagnostic ("file:line: error: ...") says most; else the first line that errs.
    wanted = [line for line in lines if "error:" in line] or [line for line in lines if "error" in line.lower()]
    return (wanted or lines or [repr(error)])[0][:200]


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH: where it is not there, the `ninja` package's (a dependency of
    the project) is put first, as in an environment used without activating it."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # here: only where no ninja is on PATH, and the package may be missing
    except ImportError:
        return  # the build then fails, saying ninja is needed
    os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, os.environ.get("PATH", "")))


def build_and_load(cxx: str) -> Path:
    """The extension's build folder, built now unless a complete build for these sources, compiler,
    flags and CPU is there (harness.kernels.cache checks it); the library is loaded into this process
    either way (its operators appear in torch.ops). RuntimeError in one line where it cannot be."""
    key = build_key(cxx)
    folder = cache.trusted_folder(cache_dir())  # one no other user can have planted a library in
    target = folder / f"{NAMESPACE}-{key}"
    if cache.problem(target, LIBRARY, key) is not None:
        if cache.publish_build(target, LIBRARY, key, lambda building: _build(cxx, key, building)):
            return target  # cpp_extension loaded what it built
    torch.ops.load_library(str(target / LIBRARY))
    return target


def _build(cxx: str, key: str, building: Path) -> None:
    """Compile and link the extension in `building` (a folder of its own, published once this returns),
    load it, stamp it."""
    from torch.utils import cpp_extension  # imported only to build

    _put_ninja_on_path()
    try:
        cpp_extension.load(NAMESPACE, [str(path) for path in sources()], extra_cflags=list(COMPILE_FLAGS),
                           extra_ldflags=list(LINK_FLAGS), build_directory=str(building), is_python_module=False)
        cache.write_stamp(building, LIBRARY, key, cxx)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(f"{cxx} could not build the kernels ({SOURCE_DIR.name}/): {_first_error(error)}") from error


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    names = ("libgomp", "libomp", "libiomp")
    return {line.split()[-1] for line in maps if any(name in line.rsplit("/", 1)[-1] for name in names)}


class Extension:
    """The extension, loaded on first use, once per process."""

    @functools.cached_property
    def _loaded(self) -> str | None:
        """None once the operators are registered, else why they cannot be."""
        cxx = compiler()
        if not cxx.strip() or shutil.which(shlex.split(cxx)[0]) is None:
            return f"no C++ compiler ({cxx}) on PATH to build the kernels"
        try:
            folder = build_and_load(cxx)
        except (RuntimeError, OSError) as error:
            return str(error)
        try:
            self.constants  # a library that loads but is not this harness's build registers no such operator
        except (AttributeError, RuntimeError) as error:
            return (f"the library in {folder} registers no {NAMESPACE}.constants ({str(error).splitlines()[0][:200]}): "
                    "not this harness's build of the kernels; remove it")
        runtimes = _openmp_runtimes()
        if len(runtimes) > 1:  # e.g. a clang build pulling in libomp beside torch's libgomp
            return (f"the kernels loaded a second OpenMP runtime ({', '.join(sorted(runtimes))}): their threads "
                    "would compete with torch's for the cores; build them with the compiler torch's runtime "
                    "matches (gcc)")
        return None

    def unavailable(self) -> str | None:
        """Why the operators cannot be had here, or None once they are registered."""
        return self._loaded

    @functools.cached_property
    def constants(self) -> dict[str, int]:
        """The kernels' constants by name (kernels.h), as the extension reports them; call `unavailable` first."""
        names, values = getattr(torch.ops, NAMESPACE).constants()
        return dict(zip(names, values))


EXTENSION = Extension()


class Kernel:
    """One kernel of the extension, as strategies and rows name it."""

    def __init__(self, source: str):
        self.source = source  # its file under csrc/
        self.name = f"{source} (fp32, OpenMP)"  # how rows name it

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why the kernel cannot run for this device and dtype, or None when it can."""
        if device.type != "cpu":
            return f"{self.source} is a CPU kernel; this point runs on {device.type}"
        if dtype != torch.float32:
            return f"{self.source} is written for float32; dtype is {str(dtype).removeprefix('torch.')}"
        return EXTENSION.unavailable()

    def shape_unsupported(self, group: int, head_dim: int) -> str | None:
        """Why an attention kernel cannot take `group` query heads per KV head of width `head_dim`, or
        None; the limits are the extension's (call `unavailable` first)."""
        most_group, most_dim = EXTENSION.constants["MAX_GROUP"], EXTENSION.constants["MAX_DIM"]
        if group > most_group or head_dim > most_dim:
            return (f"{self.source} takes at most {most_group} query heads per KV head and head_dim {most_dim}; "
                    f"this model has {group} and {head_dim}")
        return None


def ops():
    """The operators, `torch.ops.harness_kernels` (call `unavailable` first)."""
    return getattr(torch.ops, NAMESPACE)
