"""llama.cpp's library, loaded once per process: this machine's own build where one is made
(strategies.engines.artifacts.llamacpp_build, preferred), else the `llama-cpp-py-sync` wheel's.

The wheel holds libllama and libggml* built from a tagged llama.cpp commit, and CFFI declarations of
llama.h (its `_cffi_bindings.ffi`); a build made here is one extension module whose CFFI declarations
were compiled against its own llama.h. Either way this module keeps what a session needs: the library,
its ffi, the engine's version, its system info, which build it is and with what, and the engine's log
lines with their levels (llama.cpp writes them to stderr otherwise; a refused model's or context's
reason is among them, at ERROR: `said_since`).

The wheel's libraries ask for glibc 2.38 for one reason only: gcc 13 compiled their strtol, strtoul,
strtoull and sscanf calls to C23's `__isoc23_*` entry points (which also accept a 0b prefix). On an older
glibc (Debian 12 has 2.36) the dynamic loader refuses them. Here, then, `glibc_compatible_copy` copies
the wheel's libraries into the kernel cache's folder, marks that one version need weak (ELF
VER_FLG_WEAK: the loader no longer refuses a library over it), and loads beforehand a four-line shim
that forwards the `__isoc23_*` calls to this glibc's own functions. The engine's kernels are the
wheel's, byte for byte; the engine's version in a row says when the shim was used.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness.files import publish
from harness.kernels.extension import cache_dir
from strategies.engines.artifacts import llamacpp_build
from strategies.engines.engine import BUILT_HERE, WHEEL

logger = logging.getLogger("harness")
PACKAGE = "llama_cpp_py_sync"
# Which build a process runs: auto (this machine's own where one is complete, else the wheel), wheel
# (the wheel's even where a build made here exists: to measure the two against each other, to test it),
# or background (auto, and where none is built, its build started in the background: the wheel until then)
BUILD_ENV, BUILD_CHOICES = "HARNESS_LLAMACPP_BUILD", ("auto", "wheel", "background")
NEEDED_GLIBC = b"GLIBC_2.38"  # the version need of the wheel's __isoc23_* calls
SHIM_SOURCE = """#include <stdlib.h>
#include <stdio.h>
#include <stdarg.h>
long __isoc23_strtol(const char *s, char **e, int b) { return strtol(s, e, b); }
unsigned long __isoc23_strtoul(const char *s, char **e, int b) { return strtoul(s, e, b); }
unsigned long long __isoc23_strtoull(const char *s, char **e, int b) { return strtoull(s, e, b); }
long long __isoc23_strtoll(const char *s, char **e, int b) { return strtoll(s, e, b); }
int __isoc23_sscanf(const char *s, const char *f, ...) { va_list a; va_start(a, f); int r = vsscanf(s, f, a); va_end(a); return r; }
"""
SHIM = "libisoc23.so"  # the shim's library in the copy's folder, built last: its presence marks a whole copy
SHT_GNU_VERNEED, VER_FLG_WEAK = 0x6FFFFFFE, 0x2


class LibraryProblem(Exception):
    """The library cannot be loaded here; the message is the loader's or the engine's."""


ERROR_LEVEL, CONTINUED = 4, 5  # ggml_log_level: GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT (goes on with the message before)
KEPT_LINES = 200  # the engine's latest log messages kept


@dataclass
class Library:
    """The loaded engine."""

    lib: object  # the CFFI library: llama.h's functions
    ffi: object  # its CFFI declarations
    version: str  # llama.cpp's release tag and commit, as its build records them
    system_info: str  # llama_print_system_info(): the backends and the CPU features the library was built with
    build: str  # WHEEL or BUILT_HERE (strategies.engines.engine)
    build_flags: str  # what the build was made with: its cmake flags and compilers, or what the wheel says of its own
    log: list[tuple[int, int, str]] = field(default_factory=list)  # (number, level, text) of the engine's latest messages
    logged: int = 0  # messages logged so far: a mark for said_since
    _callback: object = None  # keeps the CFFI log callback alive

    @property
    def isa(self) -> str:
        """The instruction sets the CPU backend was built for, from its own system info (`AVX = 1 | AVX2 = 1`)."""
        cpu = next((part for part in self.system_info.split("CPU :")[1:]), self.system_info)
        flags = [item.split("=")[0].strip() for item in cpu.split("|") if item.strip().endswith("= 1")]
        return " ".join(flag for flag in flags if flag not in ("LLAMAFILE", "OPENMP", "REPACK", "KLEIDIAI"))

    def keep(self, level: int, text: str) -> None:
        """One log message of the engine's; a continued one (CONTINUED) is added to the message before it."""
        if level == CONTINUED and self.log:
            number, level, before = self.log[-1]
            self.log[-1] = (number, level, before + text)
            return
        self.log.append((self.logged, level, text))
        self.logged += 1
        del self.log[:-KEPT_LINES]

    def said_since(self, mark: int) -> str:
        """What the engine logged at ERROR since `mark` (a value of `logged`), its messages in order: the
        reason it gave for refusing a model or a context; its last message where it logged no error."""
        messages = [(level, text) for number, level, text in self.log if number >= mark]
        errors = [text for level, text in messages if ERROR_LEVEL <= level < CONTINUED]
        return "".join(errors or [text for _, text in messages[-1:]])


@functools.lru_cache(maxsize=1)
def load() -> Library:
    """The engine, loaded once: this machine's build where a complete one is there (unless BUILD_ENV says
    wheel; with background, one is started where none is), else the wheel's (LibraryProblem with the
    loader's message where it cannot be)."""
    chosen = os.environ.get(BUILD_ENV, "auto")
    if chosen not in BUILD_CHOICES:
        raise LibraryProblem(f"{BUILD_ENV}={chosen!r}: allowed: {', '.join(BUILD_CHOICES)}")
    folder = llamacpp_build.built() if chosen != "wheel" else None
    if folder is None and chosen == "background":
        log = llamacpp_build.start_in_background()
        logger.info(f"llama.cpp runs the wheel while its build for this machine is made in the background ({log})"
                    if log else "llama.cpp runs the wheel while another process builds it for this machine")
    library = _native(folder) if folder is not None else _wheel()
    ffi, lib = library.ffi, library.lib

    @ffi.callback("void(enum ggml_log_level, const char *, void *)")
    def keep(level, text, user_data):
        library.keep(int(level), ffi.string(text).decode(errors="replace"))

    library._callback = keep
    lib.llama_log_set(keep, ffi.NULL)
    lib.llama_backend_init()
    library.system_info = ffi.string(lib.llama_print_system_info()).decode()
    return library


def _native(folder: Path) -> Library:
    """The extension module of this machine's build in `folder` (its stamp checked by the caller)."""
    spec = importlib.util.spec_from_file_location(llamacpp_build.MODULE, folder / llamacpp_build.LIBRARY)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise LibraryProblem(f"this machine's build in {folder} does not load: {error}") from None
    info = llamacpp_build.build_info(folder)
    flags = [flag.removeprefix("-D") for flag in info["cmake_flags"] if "GGML" in flag or "BUILD_TYPE" in flag]
    return Library(lib=module.lib, ffi=module.ffi, version=info["version"], system_info="", build=BUILT_HERE,
                   build_flags=f"{' '.join(flags)}; {info['cxx']}")


def _wheel() -> Library:
    """The wheel's libraries, through a glibc-compatible copy where this glibc is older than they ask."""
    spec = importlib.util.find_spec(PACKAGE)
    folder = Path(spec.submodule_search_locations[0])
    from llama_cpp_py_sync import _version
    from llama_cpp_py_sync._cffi_bindings import ffi

    version = f"{_version.__llama_cpp_tag__} ({_version.__llama_cpp_commit__})"
    try:
        lib = ffi.dlopen(str(folder / "libllama.so"))
    except OSError as error:
        if NEEDED_GLIBC.decode() not in str(error):
            raise LibraryProblem(str(error)) from None
        try:
            lib = ffi.dlopen(str(glibc_compatible_copy(folder)))
        except (OSError, subprocess.CalledProcessError) as again:
            raise LibraryProblem(f"{error}; its glibc-compatible copy failed too: {again}") from None
        version += f", its {NEEDED_GLIBC.decode()} C23 strto*/sscanf entry points forwarded to this glibc's"
    return Library(lib=lib, ffi=ffi, version=version, system_info="", build=WHEEL,
                   build_flags=f"{PACKAGE} {_version.__version__} as published (its flags unrecorded; its ISA: engine_isa)")


def glibc_compatible_copy(folder: Path) -> Path:
    """libllama.so of a copy of the wheel's libraries that loads on glibc < 2.38 (module docstring), made
    once under the kernel cache's folder (harness.files.publish); the shim it needs is loaded into the
    process here."""
    target = cache_dir() / "llamacpp-glibc-compat" / folder.parent.name / _stamp(folder)

    def copy(building: Path) -> None:
        for library in folder.glob("lib*.so*"):
            copied = building / library.name
            shutil.copyfile(library, copied)
            weaken_version_need(copied, NEEDED_GLIBC)
        (building / "isoc23.c").write_text(SHIM_SOURCE)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(building / SHIM), str(building / "isoc23.c")],
                       check=True, capture_output=True)

    publish(target, copy, "copying llama.cpp's wheel for this glibc", complete=lambda path: (path / SHIM).exists(),
            folder=True)
    ctypes.CDLL(str(target / SHIM), mode=ctypes.RTLD_GLOBAL)  # found first for the copies' __isoc23_* references
    return target / "libllama.so"


def _stamp(folder: Path) -> str:
    library = folder / "libllama.so"
    return f"{library.stat().st_size}-{library.stat().st_mtime_ns}"


def weaken_version_need(path: Path, version: bytes) -> int:
    """Mark every need of symbol `version` in the ELF64 file at `path` weak; returns how many it marked."""
    data = bytearray(path.read_bytes())
    if data[:5] != b"\x7fELF\x02":
        raise LibraryProblem(f"{path} is not a 64-bit ELF file")
    section_table, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_table + i * entry_size) for i in range(count)]
    marked = 0
    for _, kind, _, _, offset, _, link, _, _, _ in sections:
        if kind != SHT_GNU_VERNEED:
            continue
        strings = sections[link][4]
        while True:  # Elf64_Verneed: version, count, file, aux, next
            _, needs, _, aux, following = struct.unpack_from("<HHIII", data, offset)
            entry = offset + aux
            for _ in range(needs):  # Elf64_Vernaux: hash, flags, other, name, next
                _, flags, _, name, step = struct.unpack_from("<IHHII", data, entry)
                if data[strings + name: data.index(b"\0", strings + name)] == version:
                    struct.pack_into("<H", data, entry + 4, flags | VER_FLG_WEAK)
                    marked += 1
                entry += step
            if not following:
                break
            offset += following
    path.write_bytes(bytes(data))
    return marked
