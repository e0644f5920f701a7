"""llama.cpp built from source for this machine, as a user who deploys it builds it: one command,

    python -m strategies.engines.artifacts.llamacpp_build [--sdist FILE] [--jobs N]

and the llama.cpp member runs it from then on wherever it finds it (strategies.engines.artifacts.
llamacpp_library prefers it to the wheel; the row's engine_build and engine_build_flags say which ran).

The source is the llama.cpp that the `llama-cpp-python` sdist on PyPI vendors (SDIST, its sha256 pinned:
a download that differs is refused), fetched with pip (`pip download --no-binary :all:`, so a mirror or
proxy pip is configured for serves it) unless `--sdist` names a copy. It is configured with cmake as
llama.cpp's own build does for the machine it runs on: `GGML_NATIVE=ON` (`-march=native`: here AVX-512
with VBMI, VNNI and BF16, where the wheel is built for AVX2), Release, OpenMP (its threads are torch's:
the same libgomp, so no second pool spins while another member runs), the CPU backend linked in, no
tools, tests or network code (CMAKE_FLAGS). Its static libraries are linked into one Python extension
module with llama.h's functions the member calls (CDEF): CFFI's API mode, compiled against the
source's own llama.h, so the structs the member fills (llama_context_params, llama_batch) have that
source's layout whatever the wheel's declarations say (the vendored llama.cpp is not the wheel's commit:
its llama_context_params lacks the wheel's moe_cache_size, so the wheel's declarations would write
every later field one slot off).

The build takes a minute or two on a small machine (LLAMA_BUILD_WAIT_S bounds another process's wait for it); it is
kept, like the harness's kernels (harness.kernels.cache), in a folder of the kernel cache named by its
build key (the sdist's checksum, the flags, the compilers' versions, the CPU, Python and CFFI:
`build_key`), published whole under the one lock (harness.files.publish) and stamped with the module's
size and sha256, which are checked before it is loaded: a damaged build is never loaded, and this
command builds it again. With HARNESS_LLAMACPP_BUILD=background, a first use where none is built starts
this command in the background (`start_in_background`: one compile job at the lowest priority) and runs
the wheel until the build is complete; it is not the default, since a compile on the cores a measurement
is timing makes the measurement's noise.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

from harness.files import lock_of, publish
from harness.kernels import cache
from harness.kernels.extension import _cpu_identity, _compiler_version, cache_dir

SDIST = "llama-cpp-python==0.3.36"  # the pip requirement whose sdist vendors the llama.cpp built
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = "vendor/llama.cpp"  # where the sdist keeps llama.cpp
LLAMA_CPP_COMMIT = "0c1e57098"  # the llama.cpp commit that sdist vendors (its CHANGELOG)
VERSION = f"llama.cpp {LLAMA_CPP_COMMIT} (vendored by {SDIST})"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DCMAKE_POSITION_INDEPENDENT_CODE=ON", "-DGGML_BACKEND_DL=OFF", "-DGGML_CCACHE=OFF",
               "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
               f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT}", "-DLLAMA_BUILD_NUMBER=0")
# The module's link: llama.cpp's static libraries' symbols kept inside it (never another library's to
# resolve against, nor resolved against another's: a wheel's libllama loaded in the same process), OpenMP.
LINK_FLAGS = ("-Wl,--exclude-libs,ALL", "-fopenmp", "-lpthread")
COMMAND = "strategies.engines.artifacts.llamacpp_build"  # this module, as `python -m` runs it
MODULE = "_harness_llama"  # the extension module's name (its PyInit_ symbol)
LIBRARY = f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"  # the one file a build holds, stamped
INFO = "build-info.json"  # what the build was made with, for the rows
LLAMA_BUILD_WAIT_S = 1800.0  # longest wait for another process's build of the same key (one took 1.5 minutes on 2 cores)

# llama.h as far as the member calls it. API mode: each struct ends with `...`, so the compiler lays it
# out from the source's own llama.h, and a function or field that source lacks fails the build by name.
CDEF = """
typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;
struct llama_model;
struct llama_context;
struct llama_vocab;
typedef struct llama_memory_i * llama_memory_t;
enum ggml_log_level { GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO, GGML_LOG_LEVEL_WARN,
                      GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT, ... };
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
enum ggml_type { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, ... };
enum llama_flash_attn_type { LLAMA_FLASH_ATTN_TYPE_AUTO, LLAMA_FLASH_ATTN_TYPE_DISABLED, LLAMA_FLASH_ATTN_TYPE_ENABLED, ... };
struct llama_model_params { int32_t n_gpu_layers; ...; };
struct llama_context_params {
    uint32_t n_ctx; uint32_t n_batch; uint32_t n_ubatch; uint32_t n_seq_max; int32_t n_threads; int32_t n_threads_batch;
    enum llama_flash_attn_type flash_attn_type; enum ggml_type type_k; enum ggml_type type_v; bool no_perf; bool kv_unified;
    ...;
};
typedef struct llama_batch {
    int32_t n_tokens; llama_token * token; float * embd; llama_pos * pos; int32_t * n_seq_id; llama_seq_id ** seq_id;
    int8_t * logits; ...;
} llama_batch;
struct llama_model_params llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);
void llama_backend_init(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
size_t llama_max_parallel_sequences(void);
struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);
uint32_t llama_n_ctx(const struct llama_context * ctx);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
llama_memory_t llama_get_memory(const struct llama_context * ctx);
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
"""


class BuildError(RuntimeError):
    """The build could not be made; the message is one line saying which step and why."""


def compilers() -> tuple[str, str]:
    """The C and C++ compilers: `$CC`/`$CXX` (cmake reads them too), else cc and c++."""
    return os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")


def build_key() -> str:
    """What a build depends on, hashed: the source, the flags and the declarations, the compilers and
    their versions, the CPU (-march=native), Python's and CFFI's versions (the module's ABI)."""
    import cffi

    c, cxx = compilers()
    identity = [SDIST_SHA256, *CMAKE_FLAGS, *LINK_FLAGS, CDEF, c, _compiler_version([c]), cxx, _compiler_version([cxx]),
                _cpu_identity(), sys.version, cffi.__version__]
    return hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]


def build_folder(key: str | None = None) -> Path:
    """Where this machine's build for `key` (default: build_key()) is kept."""
    return cache.trusted_folder(cache_dir()) / f"llamacpp-native-{key or build_key()}"


def built() -> Path | None:
    """The folder of this machine's complete build, its module checked against its stamp; None where none is."""
    key = build_key()
    folder = build_folder(key)
    return folder if cache.problem(folder, LIBRARY, key) is None else None


def build_info(folder: Path) -> dict:
    """What the build in `folder` was made with (INFO): version, flags, compilers."""
    return json.loads((folder / INFO).read_text())


def build(sdist: Path | None = None, jobs: int | None = None) -> Path:
    """This machine's build, made now unless a complete one is there; its folder. BuildError in one line."""
    key = build_key()
    folder = build_folder(key)
    try:
        publish(folder, lambda temporary: _make(temporary, key, sdist, jobs or os.cpu_count() or 1),
                "building llama.cpp for this machine", complete=lambda path: cache.problem(path, LIBRARY, key) is None,
                folder=True, wait_s=LLAMA_BUILD_WAIT_S)
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"llama.cpp's build in {folder.parent} failed: {error}") from None
    return folder


def start_in_background() -> Path | None:
    """Start this machine's build in a process of its own (`python -m` this module `--jobs 1`, at the
    lowest CPU priority, its lines in `.<folder>.log` beside the builds), unless one is building now; the log's path,
    or None where another process holds the build's lock. The caller runs the wheel meanwhile."""
    folder = build_folder()
    with open(lock_of(folder), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a build is under way
        fcntl.flock(lock, fcntl.LOCK_UN)
    log = folder.with_name(f".{folder.name}.log")
    with open(log, "ab") as out:
        subprocess.Popen([sys.executable, "-m", COMMAND, "--jobs", "1"], stdin=subprocess.DEVNULL, stdout=out,
                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=functools.partial(os.nice, 19))
    return log


def _make(target: Path, key: str, sdist: Path | None, jobs: int) -> None:
    """Fetch, configure, compile and link into `target` (an empty folder of this process's), then stamp it."""
    work = target / "work"  # the sdist, its source and the objects: removed once the module is linked
    work.mkdir()
    source = _unpack(sdist or _download(work / "sdist"), work / "source")
    objects = work / "build"
    _run(["cmake", "-S", str(source), "-B", str(objects), *CMAKE_FLAGS], "cmake's configure step")
    _run(["cmake", "--build", str(objects), "--target", "llama", "ggml", "-j", str(jobs)], "cmake's build")
    _link_module(source, objects, work / "module", target / LIBRARY)
    c, cxx = compilers()
    info = {"version": VERSION, "cmake_flags": list(CMAKE_FLAGS), "link_flags": list(LINK_FLAGS),
            "cc": _compiler_version([c]).splitlines()[0], "cxx": _compiler_version([cxx]).splitlines()[0],
            "sdist_sha256": SDIST_SHA256}
    (target / INFO).write_text(json.dumps(info, indent=1))
    shutil.rmtree(work)
    cache.write_stamp(target, LIBRARY, key, cxx)


def _download(folder: Path) -> Path:
    folder.mkdir(parents=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(folder), SDIST],
         f"pip download {SDIST}")
    return folder / SDIST_FILE


def _unpack(sdist: Path, folder: Path) -> Path:
    """The sdist's vendored llama.cpp, unpacked under `folder`, once its checksum is the pinned one."""
    if not sdist.is_file():
        raise BuildError(f"--sdist: {sdist} is not a file")
    found = cache.checksum(sdist)
    if found != SDIST_SHA256:
        raise BuildError(f"{sdist} has sha256 {found}, not {SDIST}'s {SDIST_SHA256}: not the source this build pins")
    with tarfile.open(sdist) as archive:
        prefix = f"{archive.getmembers()[0].name.split('/')[0]}/{VENDORED}/"
        wanted = [member for member in archive.getmembers() if member.name.startswith(prefix)]
        if not wanted:
            raise BuildError(f"{sdist} holds no {VENDORED}/")
        archive.extractall(folder, members=wanted, filter="data")
    return folder / prefix.rstrip("/")


def _link_module(source: Path, objects: Path, work: Path, library: Path) -> None:
    """CDEF's extension module, compiled against the source's llama.h and linked with its static libraries."""
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(MODULE, '#include "llama.h"')
    work.mkdir(parents=True)
    code = work / f"{MODULE}.c"
    with contextlib.redirect_stdout(io.StringIO()):  # its "generating <file>" line
        ffi.emit_c_code(str(code))
    c, cxx = compilers()
    includes = [f"-I{path}" for path in (sysconfig.get_paths()["include"], source / "include", source / "ggml" / "include")]
    _run([c, "-O2", "-fPIC", *includes, "-c", str(code), "-o", str(work / f"{MODULE}.o")], "the module's compile")
    archives = sorted(str(path) for path in objects.rglob("*.a"))  # libllama, libggml, libggml-base, libggml-cpu
    _run([cxx, "-shared", "-o", str(library), str(work / f"{MODULE}.o"), "-Wl,--start-group", *archives,
          "-Wl,--end-group", *LINK_FLAGS], "the module's link")


def _run(command: list[str], step: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise BuildError(f"{step}: {command[0]} cannot be run ({error.strerror or error})") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        said = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
        raise BuildError(f"{step} failed (exit {done.returncode}): {said[:300]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strategies.engines.artifacts.llamacpp_build",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help=f"a downloaded {SDIST_FILE} (default: pip downloads it)")
    parser.add_argument("--jobs", type=int, default=None, help="compile jobs (default: every core)")
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        print("--jobs: must be at least 1", file=sys.stderr)
        return 2
    present = built()
    if present is not None:
        print(f"llama.cpp for this machine is built: {present}")
        return 0
    print(f"building {VERSION} with {' '.join(CMAKE_FLAGS[:3])} ... for {platform.machine()} into {build_folder()}",
          flush=True)
    try:
        folder = build(args.sdist, args.jobs)
    except BuildError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"built: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
