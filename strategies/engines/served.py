"""What an engine that schedules requests itself (vLLM, strategies/engines/vllm_serving.py) is handed by a
serving run and hands back: the requests, and what it did with them in its own words and on its own
clock, which harness.serve.engine_serving maps onto the run's records. A strategy declares it serves
this way with `serves_requests` (strategies.base.Strategy) and implements `serve_requests`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ServeRequest:
    """One request handed to the engine."""

    id: int  # the request's index in the workload
    arrival_s: Optional[float]  # seconds after the run's start; None: a closed loop sends it when one finishes
    prompt_token_ids: tuple[int, ...]
    output_len: int  # tokens generated, end-of-sequence ignored


@dataclass(frozen=True)
class ServedRequest:
    """One request as the engine served it: times in seconds after the run's start, from the engine's own
    request metrics."""

    id: int
    arrival_s: float  # when it arrived (a closed loop's: when it was sent)
    queued_s: float  # the engine's scheduler received it (after the step running when it arrived)
    scheduled_s: float  # the engine first scheduled it
    first_token_s: float
    token_times_s: tuple[float, ...]  # every output token's: the end of the engine step that made it
    finish_s: float
    output_token_ids: tuple[int, ...]
    num_preemptions: int  # times the engine preempted it
    prompt_len: int


@dataclass(frozen=True)
class ServedIteration:
    """One engine step."""

    start_s: float
    end_s: float
    prefill_tokens: int  # tokens computed beyond one per decoding request: prompts, chunks, recomputation
    decodes: int  # requests that decoded a token
    running: int  # requests the step computed
    waiting: int  # requests waiting after it
    used_blocks: int  # KV blocks held while it ran (the finished requests' included)
    held_tokens: int  # tokens whose K/V those blocks hold


@dataclass(frozen=True)
class ServedEngine:
    """What the engine set up for the run: its KV cache in its own units."""

    version: str
    block_size: int
    num_blocks: int  # blocks the engine cut the budget into (a reserved one included)
    kv_tokens: int  # num_blocks * block_size: the KV tokens the engine reports
    usable_kv_tokens: int  # what requests can hold (vLLM keeps one block as its null block)
    kv_bytes_per_token: int
    kv_cache_bytes: int  # bytes the engine allocated for the cache
    threads: int
    startup_s: float  # engine start and its untimed warm-up request


@dataclass(frozen=True)
class ServedRun:
    engine: ServedEngine
    requests: tuple[ServedRequest, ...]  # in the order they finished
    iterations: tuple[ServedIteration, ...]
