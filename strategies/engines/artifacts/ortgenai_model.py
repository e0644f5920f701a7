"""The harness's weights as ONNX Runtime GenAI's builder makes them for a CPU at fp32 (strategies/engines/
ortgenai.py runs it), built once per checkpoint hash beside the engines' other copies.

The builder (`python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p fp32 -e cpu`) reads a Hugging
Face folder, or a float GGUF file only with the model's Hugging Face name for its configuration (a hub
this harness does not reach): so it reads the Hugging Face folder strategies.engines.artifacts.hf_copy
writes from the same F32 GGUF copy the other engines get. It takes a minute or so; its folder is
published whole (harness.files.publish), its last file (BUILT) marking it complete.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from harness.files import publish
from strategies.engines.artifacts.gguf_writer import weights_dir
from strategies.engines.artifacts.hf_copy import hf_folder

ENGINE = "ortgenai"  # the folder of its copies under the weights folder
BUILT = "genai_config.json"  # the builder's last file: its presence marks a complete build


class BuilderFailed(RuntimeError):
    """The builder refused the model; the message is its output (its own words, coloured as it prints them)."""


def built_model(gguf: str) -> Path:
    """The builder's fp32 CPU model of the harness's weights (built once). BuilderFailed with its output
    where it refuses them; hf_copy.NoTokenizer where the file has no tokenizer."""
    folder = weights_dir() / ENGINE / f"{Path(gguf).stem}-fp32-cpu"

    def build(building: Path) -> None:
        source = hf_folder(gguf, ENGINE)
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(building),
                   "-p", "fp32", "-e", "cpu", "-c", str(building / "cache")]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not (building / BUILT).exists():
            raise BuilderFailed(_last_words(done.stderr or done.stdout))
        shutil.rmtree(building / "cache", ignore_errors=True)  # the builder's downloads and scratch

    publish(folder, build, f"building {folder.name}", complete=lambda path: (path / BUILT).exists(), folder=True)
    return folder


def _last_words(output: str) -> str:
    """The builder's reason: its last error line (a traceback's last line), else its last line."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1]
