"""A serving run on an engine that schedules requests itself (a strategy declaring `serves_requests`:
vLLM): the workload handed to it whole, and what it reports mapped onto the run's records
(harness.serve.records), so harness.serve.metrics.summary gives its row the same columns as a run of
the harness's own scheduler.

The engine keeps its own clock from the run's start; its records map one to one:
- a request: arrival (the workload's, or for a closed loop when the engine sent it), admitted at its
  first scheduling, a time per output token (the end of the engine step that produced it), preemptions;
- an iteration: an engine step, its bytes taken being the blocks its running requests held (those that
  finished in it included) at the engine's bytes per token, its bytes holding tokens those of the tokens
  whose K/V the blocks held.
The engine's own KV facts (blocks, tokens it could hold, start-up time) come back beside the outcome
for the row, and the generated token ids for the token check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from harness.serve.records import IterationRecord, RequestRecord, ServingOutcome
from harness.serve.workload import Workload
from strategies.engines.served import ServedEngine, ServedRun, ServeRequest


@dataclass(frozen=True)
class EngineServing:
    """An engine's run of a workload, as the run's records and the engine's own facts."""

    outcome: ServingOutcome
    output_token_ids: tuple[tuple[int, ...], ...]  # per request, in index order
    engine: ServedEngine


def serve_on_engine(strategy, model, workload: Workload, prompts: Sequence[Sequence[int]], kv_budget_bytes: int,
                    max_batch: int, prefill_chunk: Optional[int] = None) -> EngineServing:
    """Hand `workload` to the strategy's engine (`prompts[i]`: request i's prompt token ids, as long as its
    prompt_len) and map what it served onto the run's records. StrategyUnavailable, in the engine's
    words, where it refuses (a skipped row)."""
    requests = [ServeRequest(r.index, r.arrival_s, tuple(int(t) for t in prompts[r.index]), r.output_len)
                for r in workload.requests]
    for request, asked in zip(requests, workload.requests):
        if len(request.prompt_token_ids) != asked.prompt_len:
            raise ValueError(f"request {asked.index}: {len(request.prompt_token_ids)} prompt ids for prompt_len {asked.prompt_len}")
    served = strategy.serve_requests(model, requests, kv_budget_bytes, max_batch, prefill_chunk, workload.concurrency)
    return as_records(workload, served)


def as_records(workload: Workload, served: ServedRun) -> EngineServing:
    """The engine's report (strategies.engines.served.ServedRun) as the run's records."""
    by_id = {record.id: record for record in served.requests}
    missing = [r.index for r in workload.requests if r.index not in by_id]
    if missing:
        raise RuntimeError(f"the engine finished {len(by_id)} of {len(workload.requests)} requests; "
                           f"not served: {missing[:8]}")
    records = tuple(RequestRecord(request, arrival_s=by_id[request.index].arrival_s,
                                  admitted_s=by_id[request.index].scheduled_s,
                                  token_times_s=list(by_id[request.index].token_times_s),
                                  preemptions=by_id[request.index].num_preemptions)
                    for request in workload.requests)
    token_bytes = served.engine.kv_bytes_per_token
    block_bytes = served.engine.block_size * token_bytes
    iterations = tuple(IterationRecord(step.start_s, step.end_s, step.prefill_tokens, step.decodes, step.running,
                                       step.waiting, step.used_blocks * block_bytes, step.held_tokens * token_bytes)
                       for step in served.iterations)
    outcome = ServingOutcome(records, iterations, sum(record.preemptions for record in records))
    tokens = tuple(tuple(by_id[request.index].output_token_ids) for request in workload.requests)
    return EngineServing(outcome, tokens, served.engine)
