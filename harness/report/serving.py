"""The section "Serving": what each strategy's memory buys under a workload (harness.serve), from the
serving rows (those with a `workload`) and their per-request files (`_requests/`).

Per setting (model, machine, workload, KV budget): a table of every strategy at every request rate
(throughput, TTFT, TPOT, E2E, goodput, the share of its taken KV memory holding tokens, the running
batch, preemptions, tokens off the exact reference); latency against request rate per strategy (the
vLLM paper's figure: normalized latency, and TTFT and TPOT medians); the latency CDFs of every request
at the highest rate; the KV memory taken and holding tokens over the run at that rate; and one plain
sentence per strategy on what its memory bought, set against a reservation-based exact strategy's
(known by its row's `serving_reserves` and `exact`, never by its name).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from harness.report import units as fmt
from harness.report.document import Block, Figure, Heading, Paragraph, Table
from harness.report.figures import PALETTE, in_units, legend_outside, log_scale, new_figure, save, title
from harness.report import guard
from harness.report.simulated import simulated_rows, simulation_section, validation_table

HEADING = "Serving: what each strategy's memory buys"
HOW_TO = ("No serving run here. Serve a workload through each strategy within one KV budget: "
          "`python -m harness.run +sweep=serving` (SmolLM2-135M, ShareGPT-like requests at three rates).")
SETTING = ["model", "device_name", "dtype", "workload", "workload_length_scale", "workload_max_tokens",
           "workload_arrival", "workload_requests", "serving_kv_budget_bytes"]
REQUESTS_DIR = "_requests"


def is_serving(table: pd.DataFrame) -> pd.Series:
    """Which rows are serving runs (the rest are step measurements)."""
    return table["workload"].notna() if "workload" in table else pd.Series(False, index=table.index)


def _requests(folders) -> pd.DataFrame:
    """Every per-request file under the results folders, one table (empty where there is none)."""
    frames = [pd.read_parquet(folder / REQUESTS_DIR) for folder in folders if (Path(folder) / REQUESTS_DIR).is_dir()]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _rate(row) -> str:
    return f"{row['workload_rate']:g}/s" if not fmt.missing(row["workload_rate"]) else str(row["workload_arrival"])


def _colours(rows: pd.DataFrame) -> dict:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(sorted(rows["strategy"].unique()))}


def serving_section(table: pd.DataFrame, folders, out: Path) -> list[Block]:
    serving = table[is_serving(table)]
    simulated = serving[simulated_rows(serving)]  # computed, never measured: kept apart (harness.report.simulated)
    rows = serving[~simulated_rows(serving)]
    blocks: list[Block] = [Heading(HEADING)]
    if serving.empty:
        return blocks + [Paragraph(HOW_TO)]
    blocks.append(Paragraph(
        "Requests of real lengths arrive over time; an iteration-level scheduler admits them first come first "
        "served while the strategy's own accounting fits the KV budget (a reservation holds prompt + max_tokens, "
        "paging a block at a time, an evicting cache its kept slots), preempts the newest by recompute where a "
        "sequence cannot grow, and decodes every running sequence at its own length. TTFT and E2E run from a "
        "request's arrival; TPOT is the time per output token after the first; goodput counts the requests "
        "meeting every objective set. **KV holding** is the share of the KV memory the running sequences took "
        "that held tokens, time-weighted over the run (the vLLM paper's measure)."))
    requests = _requests(folders)
    ok = rows[rows["status"] == "ok"]
    for index, (setting, group) in enumerate(ok.groupby(SETTING, dropna=False, sort=True)):
        blocks += _setting(dict(zip(SETTING, setting)), group, requests, out, index)
        blocks += validation_table(pd.concat([group, simulated[simulated["simulates_point_key"].isin(group["point_key"])]]))
    blocks += simulation_section(serving)
    failed = serving[serving["status"] != "ok"]
    if not failed.empty:
        blocks += [Heading("Serving runs that did not run", 3), Table(
            ["strategy", "workload", "rate", "status", "reason"],
            [[f"`{r['strategy']}`", str(r["workload"]), _rate(r), str(r["status"]), str(r["reason"])]
             for _, r in failed.iterrows()])]
    return blocks


def _setting(setting: dict, rows: pd.DataFrame, requests: pd.DataFrame, out: Path, index: int) -> list[Block]:
    scale = setting["workload_length_scale"]
    caps = "" if fmt.missing(setting["workload_max_tokens"]) else f", max_tokens {int(setting['workload_max_tokens'])}"
    blocks: list[Block] = [Heading(
        f"{setting['model']}, {setting['workload']} x{scale:g} lengths ({int(setting['workload_requests'])} requests"
        f"{caps}), KV budget {fmt.nbytes(setting['serving_kv_budget_bytes'])}, {setting['device_name']}", 3)]
    rows = rows.sort_values(["strategy", "workload_rate"])
    blocks.append(Table(
        ["strategy", "rate", "output tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "E2E p50", "goodput",
         "KV holding", "batch peak / mean", "preempted", "tokens off the reference"],
        [[f"`{r['strategy']}`", _rate(r), fmt.number(r["output_throughput"]), fmt.number(r["request_throughput"]),
          fmt.seconds(r["ttft_p50_s"]), fmt.seconds(r["ttft_p99_s"]), fmt.seconds(r["tpot_p50_s"]),
          fmt.seconds(r["e2e_p50_s"]), "–" if fmt.missing(r["goodput"]) else f"{r['goodput']:.3g}/s",
          _share(r["kv_utilization"]), f"{fmt.count(r['running_batch_peak'])} / {fmt.number(r['running_batch_mean'])}",
          fmt.count(r["preemptions"]), _off_reference(r)] for _, r in rows.iterrows()],
        [False, False] + [True] * 11))
    figures = [
        (lambda: _latency_vs_rate(rows, out, index),
         "Latency against request rate, per strategy (the vLLM paper's figure): left, the normalized latency (each "
         "request's end-to-end time over its output tokens, averaged); middle, the median time to first token; "
         "right, the median time per output token. A curve that turns up is a server past what it keeps up with.",
         "needs a strategy served at two rates or more"),
        (lambda: _cdfs(rows, requests, out, index),
         "Every request's time to first token (left) and end-to-end latency (right) at the highest rate, as "
         "cumulative distributions per strategy: how far the tail reaches, not only the median.",
         "needs the per-request files (`_requests/`)"),
        (lambda: _kv_over_time(rows, out, index),
         "The KV memory over the run at the highest rate, per strategy: what the running sequences took (dashed) "
         "and what of it held tokens (solid), against the budget (grey). A reservation takes memory its tokens "
         "never fill; paging and smaller tokens fill what they take.", "no timeline recorded"),
    ]
    for draw, caption, missing in figures:
        path, failed = guard.plot(draw)
        blocks.append(Figure(path, caption) if path is not None else Paragraph(failed or f"*(plot omitted: {missing})*"))
    blocks += _what_memory_bought(rows)
    return blocks


def _share(value) -> str:
    return "–" if fmt.missing(value) else f"{float(value):.0%}"


def _off_reference(row) -> str:
    if fmt.missing(row["tokens_checked"]):
        return "not checked"
    if row["exact"]:
        if not row["requests_diverged"]:
            return "none"
        return (f"{int(row['requests_diverged'])} request(s), first at token {int(row['first_divergence_min'])}, "
                f"margin {row['divergence_margin_min']:.2g}–{row['divergence_margin_max']:.2g}")
    return f"agrees on {row['reference_agreement']:.1%}"


def _at_top_rate(rows: pd.DataFrame) -> pd.DataFrame:
    """Each strategy's row at the highest rate it was served at (the last, for runs without a rate)."""
    ordered = rows.assign(_rate=rows["workload_rate"].fillna(np.inf)).sort_values("_rate")
    return ordered.groupby("strategy", sort=True).tail(1).drop(columns="_rate")


def _latency_vs_rate(rows: pd.DataFrame, out: Path, index: int) -> Path | None:
    rated = rows[rows["workload_rate"].notna()]
    if rated.groupby("strategy")["workload_rate"].nunique().max() < 2:
        return None
    colours = _colours(rows)
    fig, axes = new_figure(11, 3.6, columns=3)
    for ax, column, label in zip(axes, ("normalized_latency_mean_s", "ttft_p50_s", "tpot_p50_s"),
                                 ("normalized latency (s/token)", "TTFT p50", "TPOT p50")):
        for name, series in rated.groupby("strategy", sort=True):
            series = series.sort_values("workload_rate")
            ax.plot(series["workload_rate"], series[column].astype(float), marker="o", color=colours[name], label=name)
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(label)
        log_scale(ax, "y", in_units("s"))
    legend_outside(fig, axes)
    title(fig, "Latency against request rate")
    return save(fig, out, f"serving_latency_vs_rate_{index}.png")


def _cdfs(rows: pd.DataFrame, requests: pd.DataFrame, out: Path, index: int) -> Path | None:
    if requests.empty:
        return None
    top = _at_top_rate(rows)
    mine = requests[requests["point_key"].isin(set(top["point_key"]))]
    if mine.empty:
        return None
    colours = _colours(rows)
    fig, axes = new_figure(9, 3.6, columns=2)
    for ax, column, label in zip(axes, ("ttft_s", "e2e_s"), ("time to first token", "end-to-end latency")):
        for name, group in mine.groupby("strategy", sort=True):
            values = np.sort(group[column].astype(float).to_numpy())
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=colours[name], label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("share of requests")
        log_scale(ax, "x", in_units("s"))
    legend_outside(fig, axes)
    rates = ", ".join(f"{name} at {_rate(r)}" for name, r in top.set_index("strategy").iterrows())
    title(fig, f"Latency distributions at the highest rate ({rates})")
    return save(fig, out, f"serving_latency_cdf_{index}.png")


def _kv_over_time(rows: pd.DataFrame, out: Path, index: int) -> Path | None:
    top = _at_top_rate(rows)
    top = top[top["serving_timeline_s"].map(lambda t: t is not None and len(t) > 0)]
    if top.empty:
        return None
    colours = _colours(rows)
    fig, axes = new_figure(7.5, 3.8)
    budget = float(top["serving_kv_budget_bytes"].iloc[0])
    axes.axhline(budget, color="#999999", linewidth=1, label="budget")
    for _, row in top.iterrows():
        times = np.asarray(row["serving_timeline_s"], dtype=float)
        axes.plot(times, np.asarray(row["kv_taken_timeline_bytes"], dtype=float), "--", color=colours[row["strategy"]])
        axes.plot(times, np.asarray(row["kv_holding_timeline_bytes"], dtype=float), color=colours[row["strategy"]],
                  label=f"{row['strategy']} ({_rate(row)})")
    axes.set_xlabel("time from the first arrival (s)")
    axes.set_ylabel("KV bytes")
    axes.yaxis.set_major_formatter(in_units("B"))
    legend_outside(fig, [axes])
    title(fig, "KV memory taken (dashed) and holding tokens (solid) over the run")
    return save(fig, out, f"serving_kv_over_time_{index}.png")


def _what_memory_bought(rows: pd.DataFrame) -> list[Block]:
    """One sentence per strategy at the highest rate, set against a reservation-based exact strategy's."""
    top = _at_top_rate(rows)
    reserving = top[top["serving_reserves"].fillna(False).astype(bool) & top["exact"].fillna(False).astype(bool)
                    & (top["serving_placement"] == "arena")]
    base = reserving.iloc[0] if not reserving.empty else None
    sentences = []
    for _, row in top.iterrows():
        held = (f"{_share(row['kv_utilization'])} of the KV memory it took held tokens, up to "
                f"{fmt.count(row['running_batch_peak'])} sequences ran at once")
        served = (f"at {_rate(row)} it served {fmt.number(row['output_throughput'])} output tokens/s, TTFT p50 "
                  f"{fmt.seconds(row['ttft_p50_s'])}")
        if base is None or row["point_key"] == base["point_key"]:
            kind = "reserving prompt + max_tokens per request" if row["serving_reserves"] else "in its own accounting"
            sentences.append(f"`{row['strategy']}`, {kind}: {held}; {served}.")
            continue
        against = (f" (`{base['strategy']}`: {_share(base['kv_utilization'])}, {fmt.count(base['running_batch_peak'])};"
                   f" {fmt.number(base['output_throughput'])} tokens/s, TTFT p50 {fmt.seconds(base['ttft_p50_s'])})")
        gain = float(row["output_throughput"]) / float(base["output_throughput"])
        cost = "" if row["exact"] else f"; its tokens agree with the exact reference's on {row['reference_agreement']:.1%}"
        preempted = f"; {int(row['preemptions'])} preemption(s)" if row["preemptions"] else ""
        sentences.append(f"`{row['strategy']}` ({fmt.nbytes(row['serving_kv_bytes_per_token'])} a token, "
                         f"{row['serving_placement']}): {held}, and {served}, {fmt.ratio(gain)} the reservation's "
                         f"throughput{against}{cost}{preempted}.")
    return [Heading("What each strategy's memory bought", 4), Paragraph(" ".join(sentences))] if sentences else []
