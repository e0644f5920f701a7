"""Measure this code on this machine and write the figures into docs/performance.md.

Each generated block of the document sits between `<!-- perf_doc:NAME begin -->` and
`<!-- perf_doc:NAME end -->`; everything outside the markers is left as it is. The blocks:

- machine: the CPU as /proc/cpuinfo and lscpu report it, cores, caches, vector extensions, torch
  and its threads, the commit and the date;
- runner: every strategy through `python -m harness.run` on the default model (cpu_small, fp32) at
  batch {1, 8} x ctx {256, 4096} (caches filled with random K/V), no_cache at batch 1 ctx 256: the
  rows' step time, roofline fractions and bound, against the roofs calibrated in the same run;
- layouts: every cache layout's step against contiguous's in one process, interleaved rounds at a
  cache-dominated point (harness.measure.rounds, the runner's timing engine), with the memory read (a
  GEMV chain) timed in the same rounds;
- gate: the benchmark suite (tests/benchmarks) run GATE_RUNS times and the spread of every ratio and
  fact (`python -m harness.bench --spread`).

About 4-5 minutes on a 2-core CPU; run it alone on the machine (`flock /tmp/cpu.lock` on a shared one):

    python scripts/perf_doc.py                    # measure everything, rewrite the blocks
    python scripts/perf_doc.py --only machine runner --print   # print the blocks, write nothing
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
BLOCKS = ("machine", "runner", "layouts", "gate")
GATE_RUNS = 3
RUNNER_POINTS = {  # harness.run arguments per sweep; both sweeps share one results folder and its calibration
    "cached": ["strategy=contiguous,paged,dynamic,static_full,quantized", "batch=1,8", "ctx=256,4096",
               "prefill=random", "decode_tokens=16"],
    "no_cache": ["strategy=no_cache", "batch=1", "ctx=256", "decode_tokens=4"],
}
LAYOUT_POINT = {"model": "cpu_small", "batch": 8, "ctx": 4096}  # the fp32 cache is ~2.4x the weights read
LAYOUT_ROUNDS = 15


def run(command: list[str], allowed=(0,)) -> subprocess.CompletedProcess:
    """The command's result; a return code outside `allowed` ends the script with its output's tail."""
    done = subprocess.run(command, cwd=ROOT, text=True, capture_output=True)
    if done.returncode not in allowed:
        raise SystemExit(f"perf_doc: {' '.join(command)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done


def lscpu() -> dict[str, str]:
    try:
        text = run(["lscpu"]).stdout
    except (OSError, SystemExit):  # no lscpu, or it failed: /proc/cpuinfo still names the CPU
        return {}
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def machine_block() -> str:
    """The machine and software the figures below were measured on."""
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model_name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                      platform.processor() or "unknown")
    cpu = lscpu()
    flags = set(cpu.get("Flags", "").split())
    vector = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("amx_tile", "AMX")) if flag in flags]
    commit = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
    dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    rows = [
        ("CPU (/proc/cpuinfo `model name`)", model_name),
        ("CPU (lscpu `Model name`, family / model)",
         f"{cpu.get('Model name', '?')}, family {cpu.get('CPU family', '?')} model {cpu.get('Model', '?')}"),
        ("cores", f"{os.cpu_count()} logical ({cpu.get('Core(s) per socket', '?')} per socket, "
                  f"{cpu.get('Thread(s) per core', '?')} thread(s) per core), hypervisor: {cpu.get('Hypervisor vendor', 'none')}"),
        ("caches", f"L2 {cpu.get('L2 cache', '?')}, L3 {cpu.get('L3 cache', '?')}"),
        ("vector extensions", ", ".join(vector) or "none of AVX2, AVX-512, AMX"),
        ("torch", f"{torch.__version__}, {torch.get_num_threads()} intra-op threads"),
        ("Python", platform.python_version()),
        ("code", f"commit {commit}" + (" with uncommitted changes" if dirty else "")),
        ("measured", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {key} | {value} |" for key, value in rows)


def runner_block() -> str:
    """Every strategy through the runner, as a user runs it; one calibration for all rows."""
    import pandas as pd

    with tempfile.TemporaryDirectory() as results:
        for args in RUNNER_POINTS.values():
            run([sys.executable, "-m", "harness.run", "-m", "model=cpu_small", "device=cpu", "dtype=float32",
                 f"results_dir={results}", *args], allowed=(0, 1))  # 1: some point failed; its row says why
        rows = pd.read_parquet(results)
    ok = rows[rows.status == "ok"].sort_values(["strategy", "batch", "ctx"])
    first = ok.iloc[0]
    lines = [f"Roofs calibrated in the same run: read {first.roof_bandwidth_Bps / 1e9:.1f} GB/s, matmul "
             f"{first.roof_flops / 1e9:.0f} GFLOP/s (ridge {first.roof_flops / first.roof_bandwidth_Bps:.1f} FLOP/B); "
             f"{len(ok)} rows, {int(ok.noisy.fillna(False).sum())} flagged noisy.", "",
             "| strategy | batch | ctx | kernel | step | × reference in its group (95% CI) | bytes/step (model) "
             "| bandwidth fraction | FLOP fraction | roofline fraction (bound) | contention |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for row in ok.itertuples():
        lines.append(f"| {row.strategy} | {row.batch} | {row.ctx} | {short(row.kernel)} | {row.decode_step_s * 1e3:.2f} ms | "
                     f"{ratio_cell(row)} | {row.bytes_per_step_model / 1e6:,.1f} MB | {row.bandwidth_fraction:.2f} | "
                     f"{row.flops_fraction:.2f} | {row.roofline_fraction:.2f} ({row.roof_bound}) | {row.contention:.0%} |")
    not_ok = rows[rows.status != "ok"]
    if len(not_ok):
        lines += ["", "Not measured: " + "; ".join(sorted({f"{r.strategy} b={r.batch} ctx={r.ctx} ({r.status}: {r.reason})"
                                                        for r in not_ok.itertuples()}))]
    return "\n".join(lines)


def short(kernel: str) -> str:
    """A kernel's name without its description: the first word of the row's `kernel` text."""
    return kernel.split(" ")[0]


def ratio_cell(row) -> str:
    """The row's step over its group's reference's in the same rounds, with the interval ("reference"
    for the reference itself, "alone" where the row was timed without one)."""
    ratio = getattr(row, "ratio_to_reference", None)
    if ratio is None or ratio != ratio:  # absent or NaN
        return "reference" if getattr(row, "group_reference", None) == row.strategy else "alone"
    return f"{ratio:.2f} ({row.ratio_ci_low:.2f}-{row.ratio_ci_high:.2f})"


def layouts_block() -> str:
    """Each layout's step against contiguous's, interleaved in one process, beside a memory read timed
    in the same rounds. Each step advances its sequence (no rewind), as decoding does."""
    import torch
    import torch.nn.functional as F
    import yaml

    from harness.config import ModelConfig
    from harness.config.paths import config_dir
    from harness.measure.rounds import RoundsOptions, time_rounds
    from harness.model import build_model
    from strategies.caches.contiguous import ContiguousStrategy
    from strategies.caches.dynamic import DynamicStrategy
    from strategies.caches.paged import PagedStrategy
    from strategies.caches.quantized import QuantizedStrategy
    from strategies.caches.static_full import StaticFullStrategy

    shape = ModelConfig(**yaml.safe_load((config_dir() / "model" / f"{LAYOUT_POINT['model']}.yaml").read_text()))
    batch, ctx = LAYOUT_POINT["batch"], LAYOUT_POINT["ctx"]
    max_len = ctx + LAYOUT_ROUNDS + 2
    layouts = {
        "contiguous": ContiguousStrategy(), "paged, block 16": PagedStrategy(block_size=16),
        "paged, block 64": PagedStrategy(block_size=64), "dynamic": DynamicStrategy(),
        "static_full (table full)": StaticFullStrategy(max_len=max_len),
        "static_full (table 1/4 full)": StaticFullStrategy(max_len=4 * max_len),
        "quantized int8": QuantizedStrategy(format="int8"), "quantized int4": QuantizedStrategy(format="int4"),
    }
    cpu, dtype = torch.device("cpu"), torch.float32
    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(1024, 1024, generator=generator) for _ in range(64)]  # [1024, 1024] each: 256 MiB
    row = torch.randn(1, 1024, generator=generator)  # [1, 1024]
    with torch.inference_mode():
        model = build_model(shape, cpu, dtype, 0, "auto", batch_hint=batch)
        kernels, kinds = {}, {}
        for name, strategy in layouts.items():
            kinds[name] = strategy.kernel(cpu, dtype, shape)
            if kinds[name] is None:
                continue
            session = strategy.new_session(model, batch, max_len)
            session.fill_random(ctx, torch.Generator().manual_seed(0))
            token = torch.zeros(batch, dtype=torch.long)  # [B]
            kernels[name] = lambda s=session, t=token: s.step(t)
        kernels["memory read (64 GEMVs over 256 MiB)"] = lambda: [F.linear(row, m) for m in matrices]
        rounds = time_rounds(kernels, RoundsOptions(rounds=LAYOUT_ROUNDS, reference="contiguous"))
    medians, ratios = rounds.medians(), rounds.ratios()
    read_Bps = sum(m.nbytes for m in matrices) / medians.pop("memory read (64 GEMVs over 256 MiB)")
    lines = [f"`{LAYOUT_POINT['model']}` fp32, batch {batch}, {ctx} cached tokens (random K/V), {LAYOUT_ROUNDS} "
             f"interleaved rounds, medians; the memory read in the same rounds: {read_Bps / 1e9:.1f} GB/s; "
             f"other processes took {rounds.contention:.0%} of the CPUs.", "",
             "| layout | kernel | step | × contiguous |", "|---|---|---:|---:|"]
    for name, seconds in medians.items():  # × contiguous: the median of the per-round ratios
        ratio = ratios[name].median if name in ratios else 1.0
        lines.append(f"| {name} | {short(kinds[name])} | {seconds * 1e3:.2f} ms | {ratio:.2f} |")
    return "\n".join(lines)


def gate_block() -> str:
    """The benchmark suite GATE_RUNS times, then the spread of its ratios and facts."""
    with tempfile.TemporaryDirectory() as folder:
        paths = [str(Path(folder, f"run-{i}.json")) for i in range(GATE_RUNS)]
        for path in paths:
            run([sys.executable, "-m", "pytest", "-q", "-m", "benchmark", "tests/benchmarks", "-p", "no:cacheprovider",
                 f"--benchmark-json={path}"])
        others = [json.loads(Path(p).read_text())["machine_info"]["cpu_contention"]["others_fraction"] for p in paths]
        table = run([sys.executable, "-m", "harness.bench", *paths, "--spread"]).stdout.rstrip()
    return (f"{GATE_RUNS} runs of `python -m pytest -q -m benchmark tests/benchmarks`, then `python -m harness.bench "
            f"<the runs' JSON> --spread`; other processes took {', '.join(f'{o:.0%}' for o in others)} of the CPUs "
            f"in the runs.\n\n```\n{table}\n```")


def replace_block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- perf_doc:{name} begin -->", f"<!-- perf_doc:{name} end -->"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"docs/performance.md: no {begin} ... {end} markers; add them where the block belongs")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=BLOCKS, default=list(BLOCKS), help="blocks to measure")
    parser.add_argument("--print", action="store_true", help="print the blocks instead of writing the document")
    args = parser.parse_args()
    makers = {"machine": machine_block, "runner": runner_block, "layouts": layouts_block, "gate": gate_block}
    blocks = {}
    for name in args.only:
        began = time.monotonic()
        blocks[name] = makers[name]()
        print(f"perf_doc: {name} measured in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    if args.print:
        print("\n\n".join(f"## {name}\n{body}" for name, body in blocks.items()))
        return
    text = DOC.read_text()
    for name, body in blocks.items():
        text = replace_block(text, name, body)
    DOC.write_text(text)
    print(f"perf_doc: wrote {', '.join(blocks)} into {DOC.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
