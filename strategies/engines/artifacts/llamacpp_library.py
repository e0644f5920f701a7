"""llama.cpp's library as the `llama-cpp-py-sync` wheel ships it, loaded once per process.

The wheel holds libllama and libggml* built from a tagged llama.cpp commit, and CFFI declarations of
llama.h (its `_cffi_bindings.ffi`); this module opens the library through those declarations and keeps
what a session needs: the library, its ffi, the engine's version, its system info, and the engine's
log lines (llama.cpp writes them to stderr otherwise; a refused context's reason is among them).

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
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness.kernels.extension import cache_dir

PACKAGE = "llama_cpp_py_sync"
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
SHT_GNU_VERNEED, VER_FLG_WEAK = 0x6FFFFFFE, 0x2


class LibraryProblem(Exception):
    """The library cannot be loaded here; the message is the loader's or the engine's."""


@dataclass
class Library:
    """The loaded engine."""

    lib: object  # the CFFI library: llama.h's functions
    ffi: object  # the wheel's CFFI declarations
    version: str  # llama.cpp's release tag and commit, as the wheel records its build
    system_info: str  # llama_print_system_info(): the backends and the CPU features the library was built with
    log: list[str] = field(default_factory=list)  # the engine's log lines, latest last (bounded)
    _callback: object = None  # keeps the CFFI log callback alive

    @property
    def isa(self) -> str:
        """The instruction sets the CPU backend was built for, from its own system info (`AVX = 1 | AVX2 = 1`)."""
        cpu = next((part for part in self.system_info.split("CPU :")[1:]), self.system_info)
        flags = [item.split("=")[0].strip() for item in cpu.split("|") if item.strip().endswith("= 1")]
        return " ".join(flag for flag in flags if flag not in ("LLAMAFILE", "OPENMP", "REPACK", "KLEIDIAI"))

    def last_words(self, lines: int = 1) -> str:
        """The engine's last log lines (its refusal's reason is the last), for a skipped or failed row."""
        return " / ".join(line.strip() for line in self.log[-lines:] if line.strip())


@functools.lru_cache(maxsize=1)
def load() -> Library:
    """The engine, loaded once (LibraryProblem with the loader's message where it cannot be)."""
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
    library = Library(lib=lib, ffi=ffi, version=version, system_info="")

    @ffi.callback("void(enum ggml_log_level, const char *, void *)")
    def keep(level, text, user_data):
        library.log.append(ffi.string(text).decode(errors="replace"))
        del library.log[:-200]

    library._callback = keep
    lib.llama_log_set(keep, ffi.NULL)
    lib.llama_backend_init()
    library.system_info = ffi.string(lib.llama_print_system_info()).decode()
    return library


def glibc_compatible_copy(folder: Path) -> Path:
    """libllama.so of a copy of the wheel's libraries that loads on glibc < 2.38 (module docstring), made
    once under the kernel cache's folder; the shim it needs is loaded into the process here."""
    target = cache_dir() / "llamacpp-glibc-compat" / folder.parent.name / _stamp(folder)
    shim = target / "libisoc23.so"
    if not shim.exists():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for library in folder.glob("lib*.so*"):
            copied = partial / library.name
            shutil.copyfile(library, copied)
            weaken_version_need(copied, NEEDED_GLIBC)
        (partial / "isoc23.c").write_text(SHIM_SOURCE)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(partial / "libisoc23.so"), str(partial / "isoc23.c")],
                       check=True, capture_output=True)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)  # found first for the copies' __isoc23_* references
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
