"""vLLM's own engine serving a list of requests as they arrive: the script the vllm member
(strategies/engines/vllm_serving.py) runs with the Python of vLLM's virtual environment, which pins other
transformers and numpy than the harness (so this file imports only vLLM and the standard library).

    python -P vllm_worker.py SETTINGS.json REQUESTS.jsonl OUT_DIR

SETTINGS.json, one object: `model` (a Hugging Face folder), `kv_cache_bytes` (vLLM's
kv_cache_memory_bytes: the KV budget in bytes), `block_size` (tokens a KV block, null: vLLM's CPU
default), `max_model_len`, `max_num_seqs`, `max_num_batched_tokens` (null: vLLM's default),
`threads` (OpenMP threads of the forward pass), `concurrency` (a closed loop's requests in flight; null:
the arrival times are honoured).

REQUESTS.jsonl, a line per request: `id`, `arrival_s` (seconds after the run's start; null under a
closed loop: the first `concurrency` go at 0, each finish sends the next), `prompt_token_ids`, `output_len`.

OUT_DIR receives, each file a line at a time and flushed:
- `engine.json`: what vLLM set up (`version`, `block_size`, `num_blocks`, `kv_tokens` as vLLM reports
  them, `usable_kv_tokens` without its null block, `kv_bytes_per_token`, `kv_cache_bytes` allocated,
  `threads`, `startup_s`), written once the engine has started and served an untimed warm-up request.
- `error.json`: `{"error": "..."}`, vLLM's own words, when the engine cannot start or refuses a request
  (the script then exits 3).
- `requests.jsonl`, a line per finished request, every time in seconds after the run's start on one
  monotonic clock: `id`, `arrival_s`, `queued_s` (vLLM's engine core received it), `scheduled_s` (first
  scheduled), `first_token_s`, `token_times_s` (every output token's), `finish_s`, `output_token_ids`,
  `num_preemptions`, `prompt_len`: from vLLM's request metrics (RequestStateStats), a token's time
  being its engine-core step's output timestamp.
- `iterations.jsonl`, a line per engine step: `start_s`, `end_s`, `prefill_tokens`, `decodes`, `running`,
  `waiting`, `used_blocks`, `held_tokens` (tokens whose K/V the running requests hold).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): one step at a time, the
LLMEngine add_request + step loop; a request whose arrival time comes during a step is added after it
with its true arrival time, so vLLM's own queue time counts the wait. Greedy, ignore_eos, fp32, prefix
caching off (the harness's caches share nothing between requests).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path

ERROR_EXIT = 3  # the engine refused: engine.json holds its reason
WARMUP_PROMPT = 16  # tokens of the untimed warm-up request (its first forward passes allocate and load)
WARMUP_OUTPUT = 4


def _environment(threads: int) -> None:
    """Before vLLM (and torch) are imported: the engine in this process, its threads, nothing fetched."""
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # GiB, and it would override kv_cache_memory_bytes
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads),
                       "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})


class Writer:
    """A JSONL file written a line at a time, each line flushed (a killed run keeps what it finished)."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def _step_log():
    """A vLLM stat logger keeping each step's scheduler stats (its public per-step report: the batch the
    step computed, prefill and decode tokens), read by Run after the step."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepLog(StatLoggerBase):
        last = None  # the last step's SchedulerStats

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None and scheduler_stats.iteration_details is not None:
                StepLog.last = scheduler_stats.iteration_details

        def log_engine_initialized(self):
            pass

    return StepLog


def _start(settings: dict, step_log):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(model=settings["model"], dtype="float32", enforce_eager=True, seed=0,
                      kv_cache_memory_bytes=int(settings["kv_cache_bytes"]), block_size=settings.get("block_size"),
                      max_model_len=int(settings["max_model_len"]), max_num_seqs=int(settings["max_num_seqs"]),
                      max_num_batched_tokens=settings.get("max_num_batched_tokens"),
                      enable_prefix_caching=False, disable_log_stats=False, skip_tokenizer_init=True,
                      enable_logging_iteration_details=True)
    return LLMEngine.from_engine_args(args, stat_loggers=[step_log])


def _scheduler(engine):
    """The engine core's scheduler (in this process): after each step its running requests and block pool
    give the memory they hold, which vLLM's public stats give only as a fraction of blocks."""
    return engine.engine_core.engine_core.scheduler


def _engine_facts(engine, startup_s: float, threads: int) -> dict:
    import vllm

    cache = engine.vllm_config.cache_config
    allocated = sum(tensor.size for tensor in _scheduler(engine).kv_cache_config.kv_cache_tensors)
    tokens = cache.num_gpu_blocks * cache.block_size
    return {"version": vllm.__version__, "block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks,
            "kv_tokens": tokens, "usable_kv_tokens": (cache.num_gpu_blocks - 1) * cache.block_size,
            "kv_bytes_per_token": allocated // tokens, "kv_cache_bytes": allocated, "threads": threads,
            "startup_s": startup_s}


def _params(output_len: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)


def _warm_up(engine, prompt: list[int]) -> None:
    """One short request before the clock starts: the first forward passes allocate and load kernels."""
    from vllm.inputs import TokensPrompt

    engine.add_request("warm-up", TokensPrompt(prompt_token_ids=prompt[:WARMUP_PROMPT]), _params(WARMUP_OUTPUT))
    while engine.has_unfinished_requests():
        engine.step()


class Run:
    """The real-time loop: requests added as their time comes, the engine stepped while any is unfinished."""

    def __init__(self, engine, step_log, requests: list[dict], concurrency: int | None, out: Path):
        self.engine, self.step_log = engine, step_log
        self.scheduler = _scheduler(engine)
        self.block_size = engine.vllm_config.cache_config.block_size
        self.closed = concurrency is not None
        order = requests if self.closed else sorted(requests, key=lambda r: r["arrival_s"])
        self.pending = deque(order)
        if self.closed:
            for request in list(self.pending)[:concurrency]:
                request["arrival_s"] = 0.0
        self.live: dict[str, dict] = {}  # id -> the request with its output tokens and their times so far
        self.requests, self.iterations = Writer(out / "requests.jsonl"), Writer(out / "iterations.jsonl")
        self.mono0 = time.monotonic()  # the run's start on the engine core's clock
        self.wall0 = time.time()  # the same moment on the clock vLLM keeps arrival_time in

    def now(self) -> float:
        return time.monotonic() - self.mono0

    def serve(self) -> None:
        while self.pending or self.live:
            self._arrive()
            if not self.live:  # idle until the next arrival
                time.sleep(max(0.0, self.pending[0]["arrival_s"] - self.now()))
                continue
            self.step_log.last = None
            start = self.now()
            outputs = self.engine.step()
            end = self.now()
            finished = [self._tokens(output) for output in outputs]
            self._iteration(start, end, [request for request in finished if request is not None])

    def _arrive(self) -> None:
        from vllm.inputs import TokensPrompt

        now = self.now()
        while self.pending and self.pending[0]["arrival_s"] is not None and self.pending[0]["arrival_s"] <= now:
            request = self.pending.popleft()
            key = str(request["id"])
            self.live[key] = {**request, "token_times_s": [], "output_token_ids": []}
            self.engine.add_request(key, TokensPrompt(prompt_token_ids=request["prompt_token_ids"]),
                                    _params(int(request["output_len"])), arrival_time=self.wall0 + request["arrival_s"])

    def _tokens(self, output) -> dict | None:
        """A step's new tokens of one request, with their time; the request when it finished."""
        request = self.live[output.request_id]
        metrics = output.metrics
        new = list(output.outputs[0].token_ids)
        request["output_token_ids"] += new
        request["token_times_s"] += [metrics.last_token_ts - self.mono0] * len(new)
        if not output.finished:
            return None
        del self.live[output.request_id]
        self.requests.write({
            "id": request["id"], "arrival_s": request["arrival_s"], "queued_s": metrics.queued_ts - self.mono0,
            "scheduled_s": metrics.scheduled_ts - self.mono0, "first_token_s": metrics.first_token_ts - self.mono0,
            "token_times_s": request["token_times_s"], "finish_s": metrics.last_token_ts - self.mono0,
            "output_token_ids": request["output_token_ids"], "num_preemptions": metrics.num_preemptions,
            "prompt_len": len(request["prompt_token_ids"])})
        if self.closed:  # the next unsent request goes out now
            for waiting in self.pending:
                if waiting["arrival_s"] is None:
                    waiting["arrival_s"] = self.now()
                    break
        return request

    def _iteration(self, start: float, end: float, finished: list[dict]) -> None:
        """The step's record: the batch it computed (vLLM's iteration details) and the memory held while it
        ran: the running requests', and the finished ones' whose blocks the step freed at its end."""
        details = self.step_log.last
        running = list(self.scheduler.running)
        pool = self.scheduler.kv_cache_manager.block_pool
        # a finished request has computed its prompt and every output token but the last
        finished_tokens = [len(r["prompt_token_ids"]) + len(r["output_token_ids"]) - 1 for r in finished]
        decodes = details.num_generation_requests if details else 0
        self.iterations.write({
            "start_s": start, "end_s": end,
            # tokens computed beyond one per decoding request: prompts, chunks, and recomputation after a preemption
            "prefill_tokens": (details.num_ctx_tokens + details.num_generation_tokens - decodes) if details else 0,
            "decodes": decodes, "running": (details.num_ctx_requests + decodes) if details else 0,
            "waiting": len(self.scheduler.waiting),
            "used_blocks": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
            + sum(-(-tokens // self.block_size) for tokens in finished_tokens),
            "held_tokens": sum(r.num_computed_tokens for r in running) + sum(finished_tokens)})


def main(argv: list[str]) -> int:
    settings_path, requests_path, out = argv
    settings = json.loads(Path(settings_path).read_text())
    requests = [json.loads(line) for line in Path(requests_path).read_text().splitlines() if line.strip()]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = int(settings["threads"])
    _environment(threads)
    step_log = _step_log()
    began = time.monotonic()
    try:
        engine = _start(settings, step_log)
        _warm_up(engine, requests[0]["prompt_token_ids"])
    except Exception as error:  # vLLM's refusal of the model, the budget or the length, in its own words
        return _refused(out, error)
    (out / "engine.json").write_text(json.dumps(_engine_facts(engine, time.monotonic() - began, threads)))
    try:
        Run(engine, step_log, requests, settings.get("concurrency"), out).serve()
    except Exception as error:  # a request vLLM refuses (longer than max_model_len, ...)
        return _refused(out, error)
    return 0


def _refused(out: Path, error: BaseException) -> int:
    (out / "error.json").write_text(json.dumps({"error": _words(error)}))
    return ERROR_EXIT


def _words(error: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
