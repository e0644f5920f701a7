"""A serving run's workload: a list of requests, each an arrival time, a prompt length, an output length
and the output it asks for at most (`workload.*`, conf/workload/). Pure: numpy and the standard library.

Lengths (`workload.lengths`):
- `sharegpt`, `alpaca`: seeded draws whose means are the vLLM paper's (Kwon et al., "Efficient Memory
  Management for Large Language Model Serving with PagedAttention", SOSP 2023, section 6.1): ShareGPT
  mean prompt 161.31 and mean output 337.99 tokens, Alpaca 19.31 and 58.45. The paper publishes the
  means and histograms, not a spread; the draws are lognormal with the published mean and sigma
  LENGTH_SIGMA (a coefficient of variation of 1.31, a long tail like its histograms'), an assumption
  this module names rather than hides. Drawn lengths are rounded, at least 1.
- `fixed`: `prompt_len` and `output_len` for every request.
- `trace`: the file `workload.trace`: a CSV with the Azure LLM inference trace's columns `TIMESTAMP,
  ContextTokens, GeneratedTokens` (Patel et al., Splitwise, 2024; Microsoft's AzurePublicDataset), or
  JSONL with `prompt_len`, `output_len` and (for arrival=trace) `arrival_s` per line. Its first
  `requests` lines.
Every length is then multiplied by `length_scale` (rounded, at least 1): the workload's shape at a size
this machine serves in minutes, the unscaled workload one override away. Outputs are cut to
`max_tokens` where it is set; it is also what a reservation-based server reserves for.

Arrivals (`workload.arrival`), seconds from the run's start:
- `all_at_once`: every request at 0 (offline throughput; vLLM's request rate `inf`);
- `poisson`: exponential gaps at `rate` requests a second;
- `gamma`: gamma gaps of shape `burstiness` and mean 1 / rate (vLLM's --burstiness: 1 is Poisson,
  lower is burstier);
- `closed`: `concurrency` requests in flight, the next sent when one finishes (arrival_s None here:
  the scheduler sets it);
- `trace`: the trace's own times, from its first request.
The first request of `poisson` and `gamma` arrives at 0, as vLLM's benchmark sends its first at once.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from harness.config.validate import ConfigError, first_line, one_of, positive_float, positive_int

# name -> (mean prompt tokens, mean output tokens): the vLLM paper's Table/section 6.1 figures
PUBLISHED_MEANS = {
    "sharegpt": (161.31, 337.99),
    "alpaca": (19.31, 58.45),
}
LENGTH_SIGMA = 1.0  # the lognormal draws' sigma (an assumption: the paper gives means, not a spread)
LENGTH_SOURCES = (*PUBLISHED_MEANS, "fixed", "trace")
ARRIVALS = ("all_at_once", "poisson", "gamma", "closed", "trace")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
JSONL_FIELDS = ("prompt_len", "output_len", "arrival_s")
REQUESTS_MAX = 1_000_000  # requests of one run: each is a row of the per-request file
TRACE_MAX_BYTES = 1 << 30  # a trace file read whole at most


@dataclass(frozen=True)
class Request:
    """One request of a workload; `index` is its place in the workload (the FCFS tie-break)."""

    index: int
    arrival_s: Optional[float]  # seconds after the run's start; None: a closed loop sends it (the scheduler)
    prompt_len: int  # prompt tokens
    output_len: int  # output tokens it generates (greedy, end-of-sequence ignored)
    max_tokens: int  # output it asks for at most: what a reservation-based server reserves beside the prompt

    @property
    def reserve(self) -> int:
        """Tokens a reservation-based server reserves for it: prompt + max_tokens."""
        return self.prompt_len + self.max_tokens


@dataclass(frozen=True)
class Workload:
    """The requests, in index order, and how they arrive."""

    requests: tuple[Request, ...]
    concurrency: Optional[int] = None  # a closed loop's requests in flight; None: arrivals are set

    @property
    def closed(self) -> bool:
        return self.concurrency is not None


def build_workload(cfg, seed: int) -> Workload:
    """The workload a `workload` config describes (a WorkloadConfig or a DictConfig of one); ConfigError
    naming the key for a value or a trace it cannot use."""
    check_config(cfg)
    rng = np.random.default_rng([seed, 0x5E4E])  # the lengths and the arrivals: one stream, one fixed order
    trace = read_trace(cfg.trace, cfg.requests, with_arrivals=cfg.arrival == "trace") \
        if (cfg.lengths == "trace" or cfg.arrival == "trace") else None
    count = len(trace["prompt_len"]) if trace is not None else cfg.requests
    prompts, outputs = (_scaled(lengths, cfg.length_scale) for lengths in _lengths(cfg, rng, count, trace))
    if cfg.max_tokens is not None:
        outputs = np.minimum(outputs, cfg.max_tokens)
    arrivals = _arrivals(cfg, rng, count, trace)
    requests = tuple(
        Request(i, None if arrivals is None else float(arrivals[i]), int(prompts[i]), int(outputs[i]),
                int(cfg.max_tokens if cfg.max_tokens is not None else outputs[i]))
        for i in range(count))
    return Workload(requests, cfg.concurrency if cfg.arrival == "closed" else None)


def check_config(cfg) -> None:
    """The workload's values, before any is used: one ConfigError naming the key."""
    one_of("workload.lengths", cfg.lengths, LENGTH_SOURCES)
    one_of("workload.arrival", cfg.arrival, ARRIVALS)
    positive_int("workload.requests", cfg.requests, at_most=REQUESTS_MAX)
    positive_int("workload.prompt_len", cfg.prompt_len, at_most=2**31 - 1)
    positive_int("workload.output_len", cfg.output_len, at_most=2**31 - 1)
    positive_float("workload.length_scale", cfg.length_scale, at_least=1e-6, at_most=1e6)
    if cfg.max_tokens is not None:
        positive_int("workload.max_tokens", cfg.max_tokens, at_most=2**31 - 1)
    if cfg.arrival in ("poisson", "gamma"):
        if cfg.rate is None:
            raise ConfigError("workload.rate", f"arrival={cfg.arrival} needs a rate: requests per second above 0")
        positive_float("workload.rate", cfg.rate)
    positive_float("workload.burstiness", cfg.burstiness, at_least=1e-3, at_most=1e3)
    if cfg.arrival == "closed":
        if cfg.concurrency is None:
            raise ConfigError("workload.concurrency", "arrival=closed needs the requests kept in flight: an integer from 1")
        positive_int("workload.concurrency", cfg.concurrency, at_most=REQUESTS_MAX)
    if (cfg.lengths == "trace" or cfg.arrival == "trace") and cfg.trace is None:
        raise ConfigError("workload.trace", f"lengths={cfg.lengths} arrival={cfg.arrival} reads a trace: name its file "
                                            f"(a CSV with {', '.join(AZURE_COLUMNS)}, or JSONL with {', '.join(JSONL_FIELDS)})")


def _lengths(cfg, rng, count: int, trace) -> tuple[np.ndarray, np.ndarray]:
    if cfg.lengths == "trace":
        return trace["prompt_len"].astype(np.float64), trace["output_len"].astype(np.float64)
    if cfg.lengths == "fixed":
        return np.full(count, float(cfg.prompt_len)), np.full(count, float(cfg.output_len))
    prompt_mean, output_mean = PUBLISHED_MEANS[cfg.lengths]
    return lognormal(rng, prompt_mean, count), lognormal(rng, output_mean, count)


def _scaled(lengths: np.ndarray, scale: float) -> np.ndarray:
    """Token counts: the lengths rounded (at least 1), then times `scale` rounded again (at least 1), so a
    scaled workload's lengths are its unscaled workload's, scaled."""
    tokens = np.maximum(1, np.rint(lengths))
    return np.maximum(1, np.rint(tokens * scale)).astype(np.int64)


def lognormal(rng, mean: float, count: int) -> np.ndarray:
    """`count` lognormal draws of the given mean and sigma LENGTH_SIGMA: mu = ln(mean) - sigma^2 / 2."""
    return rng.lognormal(math.log(mean) - LENGTH_SIGMA ** 2 / 2, LENGTH_SIGMA, count)


def _arrivals(cfg, rng, count: int, trace) -> Optional[np.ndarray]:
    arrival = cfg.arrival
    if arrival == "closed":
        return None
    if arrival == "all_at_once":
        return np.zeros(count)
    if arrival == "trace":
        times = trace["arrival_s"]
        return times - times[0]
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / cfg.rate, count)
    else:  # gamma: shape k, scale 1 / (rate k), so the mean gap stays 1 / rate (vLLM's convention)
        gaps = rng.gamma(cfg.burstiness, 1.0 / (cfg.rate * cfg.burstiness), count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def read_trace(path: str, limit: int, with_arrivals: bool) -> dict[str, np.ndarray]:
    """The first `limit` requests of a trace file: prompt_len, output_len and arrival_s arrays (arrival_s
    only `with_arrivals`, and then non-decreasing). ConfigError on workload.trace for a file that is
    missing, empty, malformed, or holds lengths below 1."""
    key = "workload.trace"
    file = Path(str(path)).expanduser()
    try:
        if not file.is_file():
            raise ConfigError(key, f"'{path}' is not a file")
        if file.stat().st_size > TRACE_MAX_BYTES:
            raise ConfigError(key, f"'{path}' is over {TRACE_MAX_BYTES:,} bytes; cut it to the requests wanted")
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(key, f"'{path}' is not UTF-8 text (a CSV or JSONL trace)") from None
    except OSError as error:
        raise ConfigError(key, f"cannot read '{path}': {error.strerror or first_line(error)}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ConfigError(key, f"'{path}' is empty: a trace needs at least one request")
    rows = _jsonl_rows(lines, path, limit, with_arrivals) if file.suffix == ".jsonl" else \
        _csv_rows(lines, path, limit, with_arrivals)
    if not rows:
        raise ConfigError(key, f"'{path}' holds a header and no request")
    columns = {name: np.asarray([row[i] for row in rows]) for i, name in enumerate(JSONL_FIELDS[: len(rows[0])])}
    for name in ("prompt_len", "output_len"):
        low = int(np.argmin(columns[name]))
        if columns[name][low] < 1:
            raise ConfigError(key, f"'{path}' request {low + 1} has {name} {columns[name][low]}: lengths are tokens, at least 1")
    if with_arrivals:
        times = columns["arrival_s"]
        back = np.flatnonzero(np.diff(times) < 0)
        if back.size:
            raise ConfigError(key, f"'{path}' request {back[0] + 2} arrives before the one above it: a trace's times "
                                   "must not decrease")
    return columns


def _jsonl_rows(lines: list[str], path: str, limit: int, with_arrivals: bool) -> list[tuple]:
    wanted = JSONL_FIELDS if with_arrivals else JSONL_FIELDS[:2]
    rows = []
    for number, line in enumerate(lines[:limit], start=1):
        try:
            entry = json.loads(line)
        except ValueError as error:
            raise ConfigError("workload.trace", f"'{path}' line {number} is not JSON ({first_line(error, typed=False)})") from None
        if not isinstance(entry, dict) or any(name not in entry for name in wanted):
            raise ConfigError("workload.trace", f"'{path}' line {number} must be an object with {', '.join(wanted)}")
        rows.append(tuple(_number(entry[name], name, path, number, integer=name != "arrival_s") for name in wanted))
    return rows


def _csv_rows(lines: list[str], path: str, limit: int, with_arrivals: bool) -> list[tuple]:
    header = [name.strip() for name in lines[0].split(",")]
    missing = [name for name in AZURE_COLUMNS if name not in header]
    if missing:
        raise ConfigError("workload.trace", f"'{path}' has no column {', '.join(missing)}: a CSV trace has the Azure LLM "
                                            f"inference trace's columns {', '.join(AZURE_COLUMNS)} (or give a .jsonl file)")
    at = {name: header.index(name) for name in AZURE_COLUMNS}
    rows, first = [], None
    for number, line in enumerate(lines[1: limit + 1], start=2):
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(header):
            raise ConfigError("workload.trace", f"'{path}' line {number} has {len(cells)} fields, the header {len(header)}")
        prompt = _number(cells[at["ContextTokens"]], "ContextTokens", path, number, integer=True)
        output = _number(cells[at["GeneratedTokens"]], "GeneratedTokens", path, number, integer=True)
        if not with_arrivals:
            rows.append((prompt, output))
            continue
        stamp = _timestamp(cells[at["TIMESTAMP"]], path, number)
        first = stamp if first is None else first
        rows.append((prompt, output, (stamp - first) / np.timedelta64(1, "s")))
    return rows


def _number(value, name: str, path: str, line: int, integer: bool):
    """A trace field's value: an integer (lengths) or a finite number (times); ConfigError otherwise."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or (integer and number != int(number)):
        kind = "an integer" if integer else "a finite number of seconds"
        raise ConfigError("workload.trace", f"'{path}' line {line}: {name} must be {kind}, got {value!r}")
    return int(number) if integer else number


def _timestamp(text: str, path: str, line: int) -> np.datetime64:
    """The Azure trace's TIMESTAMP ('2023-11-16 18:15:46.6805900'), to the microsecond."""
    date, _, fraction = text.replace("T", " ").partition(".")
    try:
        stamp = np.datetime64(date.replace(" ", "T"), "us")
        if fraction:
            stamp += np.timedelta64(int(round(float("0." + fraction) * 1e6)), "us")
    except ValueError:
        raise ConfigError("workload.trace", f"'{path}' line {line}: TIMESTAMP {text!r} is not a date and time "
                                            "('2023-11-16 18:15:46.6805900')") from None
    return stamp
