"""The workload (harness.serve.workload): published means, seeded draws, arrival processes, traces read
and refused in one line naming workload.trace."""
from __future__ import annotations

import json

import numpy as np
import pytest

from harness.config.schema import WorkloadConfig
from harness.config.validate import ConfigError
from harness.serve.workload import PUBLISHED_MEANS, build_workload


def workload(**fields):
    return WorkloadConfig(**{"requests": 16, "rate": 2.0, **fields})


@pytest.mark.parametrize("name", sorted(PUBLISHED_MEANS))
def test_synthetic_lengths_follow_the_published_means(name):
    """Many draws average near the paper's means (lognormal, one shared seed)."""
    built = build_workload(workload(name=name, lengths=name, requests=20_000), seed=0)
    prompts = np.mean([r.prompt_len for r in built.requests])
    outputs = np.mean([r.output_len for r in built.requests])
    prompt_mean, output_mean = PUBLISHED_MEANS[name]
    assert prompts == pytest.approx(prompt_mean, rel=0.05)
    assert outputs == pytest.approx(output_mean, rel=0.05)
    assert min(r.prompt_len for r in built.requests) >= 1


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    a, b, c = (build_workload(workload(), seed) for seed in (3, 3, 4))
    assert a == b
    assert a != c


def test_length_scale_and_max_tokens():
    plain = build_workload(workload(lengths="sharegpt"), seed=1)
    scaled = build_workload(workload(lengths="sharegpt", length_scale=0.25, max_tokens=40), seed=1)
    for p, s in zip(plain.requests, scaled.requests):
        assert s.prompt_len == max(1, round(p.prompt_len * 0.25))
        assert s.output_len == min(40, max(1, round(p.output_len * 0.25)))
        assert s.max_tokens == 40 and s.reserve == s.prompt_len + 40
    assert all(r.max_tokens == r.output_len for r in plain.requests)  # None: each request's own length


def test_poisson_and_gamma_arrivals_keep_the_rate():
    for arrival, burstiness in (("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0)):
        built = build_workload(workload(requests=20_000, rate=8.0, arrival=arrival, burstiness=burstiness), seed=0)
        times = np.asarray([r.arrival_s for r in built.requests])
        assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
        assert np.mean(np.diff(times)) == pytest.approx(1 / 8.0, rel=0.05)
    bursty = np.diff([r.arrival_s for r in build_workload(workload(requests=5000, arrival="gamma", burstiness=0.25), 0).requests])
    steady = np.diff([r.arrival_s for r in build_workload(workload(requests=5000, arrival="gamma", burstiness=4.0), 0).requests])
    assert np.std(bursty) > 2 * np.std(steady)  # lower burstiness, more spread-out gaps


def test_all_at_once_and_closed_loop():
    assert {r.arrival_s for r in build_workload(workload(arrival="all_at_once"), 0).requests} == {0.0}
    closed = build_workload(workload(arrival="closed", concurrency=3), 0)
    assert closed.closed and closed.concurrency == 3 and all(r.arrival_s is None for r in closed.requests)


def test_azure_csv_trace(tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,396,109\n"
                     "2023-11-16 18:15:51.1000000,879,55\n")
    built = build_workload(workload(lengths="trace", trace=str(trace), arrival="trace", requests=2), 0)
    assert [(r.prompt_len, r.output_len) for r in built.requests] == [(374, 44), (396, 109)]
    assert built.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    lengths_only = build_workload(workload(lengths="trace", trace=str(trace), arrival="poisson"), 0)
    assert len(lengths_only.requests) == 3


def test_jsonl_trace(tmp_path):
    trace = tmp_path / "requests.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": p, "output_len": o, "arrival_s": t})
                               for p, o, t in ((10, 5, 0.5), (20, 7, 1.5))) + "\n")
    built = build_workload(workload(lengths="trace", trace=str(trace), arrival="trace"), 0)
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in built.requests] == [(10, 5, 0.0), (20, 7, 1.0)]


@pytest.mark.parametrize("name, text, says", [
    ("empty.csv", "", "is empty"),
    ("header.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "no request"),
    ("columns.csv", "time,prompt,output\n1,2,3\n", "no column TIMESTAMP"),
    ("zero.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,4\n", "at least 1"),
    ("negative.jsonl", '{"prompt_len": 4, "output_len": -2, "arrival_s": 0}\n', "at least 1"),
    ("float.jsonl", '{"prompt_len": 4.5, "output_len": 2, "arrival_s": 0}\n', "must be an integer"),
    ("broken.jsonl", '{"prompt_len": 4,\n', "is not JSON"),
    ("fields.jsonl", '{"prompt": 4}\n', "must be an object with prompt_len"),
    ("time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", "is not a date"),
    ("backwards.jsonl", '{"prompt_len": 4, "output_len": 2, "arrival_s": 5}\n{"prompt_len": 4, "output_len": 2, "arrival_s": 1}\n',
     "arrives before"),
])
def test_a_bad_trace_is_refused_naming_the_key(tmp_path, name, text, says):
    trace = tmp_path / name
    trace.write_text(text)
    with pytest.raises(ConfigError, match=says) as refused:
        build_workload(workload(lengths="trace", trace=str(trace), arrival="trace"), 0)
    assert refused.value.key == "workload.trace"
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("fields, key", [
    ({"rate": 0.0}, "workload.rate"),
    ({"rate": None}, "workload.rate"),
    ({"rate": -1.0}, "workload.rate"),
    ({"prompt_len": 0, "lengths": "fixed"}, "workload.prompt_len"),
    ({"output_len": -3, "lengths": "fixed"}, "workload.output_len"),
    ({"requests": 0}, "workload.requests"),
    ({"lengths": "wikipedia"}, "workload.lengths"),
    ({"arrival": "closed"}, "workload.concurrency"),
    ({"lengths": "trace"}, "workload.trace"),
    ({"trace": "/no/such/file.csv", "lengths": "trace"}, "workload.trace"),
    ({"max_tokens": 0}, "workload.max_tokens"),
])
def test_bad_workload_values_are_refused_naming_the_key(fields, key):
    with pytest.raises(ConfigError) as refused:
        build_workload(workload(**fields), 0)
    assert refused.value.key == key
