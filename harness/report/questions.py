"""The section answering the questions a KV cache raises (why K/V and not Q, bytes per token, growth
with length, FLOPs against time, prefill against decode, when the cache outweighs the weights, equal
batch x tokens): analytic figures for Llama 3 70B on an H100, and the measured figures of the rows at
hand beside them.

Each answer is a function returning blocks; each states the analytic number first, then what the
rows show, and says plainly when the rows at hand cannot show it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from harness.report import guard
from harness.report import units as fmt
from harness.report.document import Block, Bullets, Heading, Paragraph, Table
from harness.report.cohorts import Cohort, cached_rows, ordered_strategies, recompute_rows, SERIES
from harness.report.plots import measured_ratio, positive

# `ref`: the example deployment's figures, harness.analysis.curves.example_figures (a dict of named
# numbers, computed by the loader's step: this module does no arithmetic of the model).


def _ref_line(ref: dict) -> str:
    return (f"Llama 3 70B, {ref['dtype']}, H100 SXM datasheet roof ({fmt.rate(ref['roof'].bytes_per_s, 'B/s')}, "
            f"{fmt.rate(ref['roof'].flops_per_s, 'FLOP/s')})")


def cacheable(ref: dict, table: pd.DataFrame) -> list[Block]:
    out = [Heading("Why keys and values can be cached and queries cannot", 3), Paragraph(
        "The key and value of token j are projections of token j's hidden state at position j; causal "
        "attention means no later token changes that state, so they are the same at every later step and "
        "can be kept. A query is used only by the step that creates it: the next step needs the next "
        "token's query, which did not exist before. If caching were inexact, the cached strategies would "
        "generate different tokens from the reference (`no_cache`), which recomputes everything from the token ids.")]
    ok = table[(table["status"] == "ok")]
    recomputes = recompute_rows(ok)
    if recomputes.empty:
        return out + [Paragraph("**Measured:** no rows of the recompute reference with token digests here, so "
                                "nothing to compare.")]
    keys = ["model", "dtype", "device", "batch", "ctx", "decode_tokens", "prefill"]
    reference = recomputes[keys + ["tokens_digest"]].drop_duplicates(keys)
    lines = []
    for strategy in ordered_strategies(cached_rows(ok)):
        mine = ok[ok[SERIES] == strategy]
        exact = bool(mine["exact"].fillna(False).astype(bool).all())
        both = mine[keys + ["tokens_digest"]].drop_duplicates(keys).merge(reference, on=keys, suffixes=("", "_ref"))
        if both.empty:
            continue
        same = int((both["tokens_digest"] == both["tokens_digest_ref"]).sum())
        verdict = ("" if same == len(both) else " (**some differ: see the rows table**)") if exact else \
            " (an approximate cache: its accuracy columns say how far it moved)"
        lines.append(f"`{strategy}`: {same} of {len(both)} points generated exactly the reference's tokens{verdict}")
    return out + [Paragraph("**Measured:** greedy tokens compared by digest, point by point:"),
                  Bullets(lines or ["no point ran both the reference and a cached strategy"])]


def bytes_per_token(ref: dict, cohorts: list[Cohort], published: pd.DataFrame) -> list[Block]:
    s = ref["shape"]
    out = [Heading("Cache bytes per token, for any shape and dtype", 3), Paragraph(
        "`kv_bytes_per_token = 2 × n_layers × n_kv_heads × head_dim × bytes_per_element`: one key and one "
        f"value per layer and KV head. {_ref_line(ref)}: 2 × {s.n_layers} × {s.n_kv_heads} × "
        f"{s.resolved_head_dim} × 2 = **{ref['kv_bytes_per_token']:,} B "
        f"({fmt.nbytes(ref['kv_bytes_per_token'])})**. Batch, query heads and the "
        "attention pattern do not enter it.")]
    header = ["model", "dtype", "kv bytes/token", "weights", "tokens to match weights"]
    body = [[p.model, p.dtype, f"{p.kv_bytes_per_token:,} B", fmt.nbytes(p.weight_bytes), f"{p.tokens_to_match_weights:,.0f}"]
            for p in published.itertuples()]
    out.append(Table(header, body, [False, False, True, True, True]))
    measured = []
    for g in cohorts:
        cached = cached_rows(g.ok).dropna(subset=["kv_cache_bytes"])
        cached = cached[(cached["kv_cache_bytes"] > 0) & (cached[SERIES] == g.plain_cache())]
        if cached.empty:
            continue
        per_token = cached["kv_cache_bytes"] / (cached["batch"] * (cached["ctx"] + cached["decode_tokens"]))
        measured.append(f"{g.title}: allocated cache ÷ (batch × (ctx + decode_tokens)) = "
                        f"{per_token.min():,.0f} – {per_token.max():,.0f} B per token over {len(cached)} rows; "
                        f"analytic {g.figures['kv_bytes_per_token']:,} B")
    out.append(Paragraph("**Measured:**"))
    out.append(Bullets(measured or ["no cached rows with cache bytes here"]))
    return out


def growth(ref: dict, cohorts: list[Cohort]) -> list[Block]:
    out = [Heading("How work grows with length: no cache against cache", 3), Paragraph(
        "Decode step i after a p-token prompt sits at context c = p + i. With a cache it runs one token: "
        "2 × (matmul weights) FLOPs plus one query over c + 1 keys (4 × (c + 1) × n_heads × head_dim per "
        "layer): **linear** in c, so n steps cost a total quadratic only in the small attention term. "
        "Without a cache it re-runs all c + 1 tokens: 2 × (matmul weights) × (c + 1) plus causal attention "
        "over (c + 1)(c + 2)/2 pairs: **quadratic** per step, cubic in total attention work.")]
    header = ["context c", "FLOPs/step, cache", "FLOPs/step, no cache", "FLOP ratio",
              f"total over {ref['steps']} steps, cache", "total, no cache"]
    body = [[f"{g['ctx']:,}", fmt.flops(g["flops_cached"]), fmt.flops(g["flops_full"]),
             fmt.ratio(g["flops_full"] / g["flops_cached"]), fmt.flops(g["total_cached"]), fmt.flops(g["total_full"])]
            for g in ref["growth"]]
    out += [Paragraph(f"{_ref_line(ref)}, batch 1:"), Table(header, body, [True] * len(header))]
    measured = []
    for g in cohorts:
        for strategy in g.strategies():
            for batch in sorted(g.ok["batch"].unique()):
                rows = g.ok[(g.ok[SERIES] == strategy) & (g.ok["batch"] == batch)].dropna(subset=["decode_step_s"])
                if rows["ctx"].nunique() < 2:
                    continue
                slope = np.polyfit(np.log(rows["ctx"].astype(float)), np.log(rows["decode_step_s"].astype(float)), 1)[0]
                low, high = rows.sort_values("ctx").iloc[[0, -1]].itertuples()
                measured.append(f"{g.model} {g.dtype}, `{strategy}`, batch {batch}: step time × "
                                f"{high.decode_step_s / low.decode_step_s:.3g} from ctx {low.ctx:,} to {high.ctx:,} "
                                f"(×{high.ctx / low.ctx:.3g} context); log-log slope {slope:.2f}")
    out += [Paragraph("**Measured** (slope 0: flat, 1: linear, 2: quadratic in context):"),
            Bullets(measured or ["no strategy ran at two contexts here"])]
    return out


def wall_clock_gap(ref: dict, cohorts: list[Cohort]) -> list[Block]:
    r, p = ref["roof"], ref["ctx"]
    cached_b, cached_f, full_f = ref["cached_bytes"], ref["cached_flops"], ref["full_flops"]
    t_cached, t_full = ref["cached_step_s"], ref["full_step_s"]
    out = [Heading("Why the wall-clock speedup is far below the FLOP saving", 3), Paragraph(
        f"{_ref_line(ref)}, batch 1, context {p:,}: the cache cuts a step's FLOPs by "
        f"**{full_f / cached_f:,.0f}x** ({fmt.flops(full_f)} → {fmt.flops(cached_f)}), but the cached step "
        f"still moves {fmt.nbytes(cached_b)} (all weights plus the cache) for those {fmt.flops(cached_f)}: "
        f"an intensity of {cached_f / cached_b:.2f} FLOP/B against a ridge of {r.ridge:.0f} FLOP/B. It waits "
        f"on memory: {fmt.seconds(t_cached)} at the bandwidth roof, while its FLOPs alone would take "
        f"{fmt.seconds(cached_f / r.flops_per_s)}. The no-cache step is compute bound at {fmt.seconds(t_full)}. "
        f"So the predicted time saving is **{t_full / t_cached:,.1f}x**, not {full_f / cached_f:,.0f}x: "
        "removing arithmetic from a step that was waiting on bytes saves little time.")]
    header = ["model", "batch", "ctx", "FLOP ratio", "roofline time ratio", "measured time ratio"]
    body, flop_ratios, measured_ratios = [], [], []
    for g in cohorts:
        recompute = sorted(recompute_rows(g.ok)[SERIES].unique())[:1]
        for cached_name in ordered_strategies(cached_rows(g.ok)) if recompute else []:
            for batch in sorted(g.ok["batch"].unique()):
                for ctx, measured in measured_ratio(g.ok, int(batch), cached_name):
                    flop_ratio, time_ratio = (g.at(recompute[0], batch, ctx, column) / g.at(cached_name, batch, ctx, column)
                                              for column in ("flops_per_step_model", "predicted_step_s"))
                    body.append([f"{g.model} {g.dtype} ({cached_name})", fmt.count(batch), fmt.count(ctx),
                                 fmt.ratio(flop_ratio), fmt.ratio(time_ratio), fmt.ratio(measured)])
                    flop_ratios.append(flop_ratio)
                    measured_ratios.append(measured)
    out.append(Paragraph("**Measured**, the recompute reference ÷ each cache, per decode step (see also the plot above):"))
    if not body:
        return out + [Paragraph("No point ran both the recompute reference and a cached strategy.")]
    return out + [Table(header, body, [False] + [True] * 5), Paragraph(
        f"On the rows at hand the cache saves up to **{max(flop_ratios):,.0f}x** the FLOPs but at most "
        f"**{max(measured_ratios):,.3g}x** the time (median over points: {np.median(flop_ratios):,.0f}x "
        f"FLOPs against {np.median(measured_ratios):,.3g}x time).")]


def prefill_decode(ref: dict, cohorts: list[Cohort]) -> list[Block]:
    p, pre, dec = ref["ctx"], ref["prefill_bytes_per_token"], ref["decode_bytes_per_token"]
    out = [Heading("Prefill against decode: bytes per token", 3), Paragraph(
        f"Prefill pushes the p prompt tokens through one read of the weights; decode reads the weights and "
        f"the cache for every token. {_ref_line(ref)}, batch 1, p = {p:,}: prefill "
        f"**{fmt.nbytes(pre)} per token**, decode **{fmt.nbytes(dec)} per token**, a ratio of "
        f"**{dec / pre:,.0f}x** (about p; the same FLOPs per token). Predicted time per token: prefill "
        f"{fmt.seconds(ref['prefill_s'] / p)}, decode {fmt.seconds(ref['cached_step_s'])}.")]
    measured, time_ratios = [], []
    for g in cohorts:
        rows = positive(cached_rows(g.ok), "prefill_s", "decode_step_s")  # a prefill timed at 0 has no time per token
        byte_ratios = {}  # (batch, ctx): the analytic ratio is the point's, whichever row of it, so looked up once
        for _, r in rows[["strategy", "batch", "ctx", "prefill_s", "decode_step_s"]].sort_values(["batch", "ctx"]).iterrows():
            pre_t = r["prefill_s"] / (r["batch"] * r["ctx"])
            dec_t = r["decode_step_s"] / r["batch"]
            point = (r["batch"], r["ctx"])
            if point not in byte_ratios:
                byte_ratios[point] = (g.at(None, *point, "decode_bytes_per_token") / g.at(None, *point, "prefill_bytes_per_token"))
            b_ratio = byte_ratios[point]
            measured.append([f"{g.model} {g.dtype} {r['strategy']}", fmt.count(r["batch"]), fmt.count(r["ctx"]),
                             fmt.ratio(b_ratio), fmt.seconds(pre_t), fmt.seconds(dec_t), fmt.ratio(dec_t / pre_t)])
            time_ratios.append(dec_t / pre_t)
    out.append(Paragraph("**Measured** time per token (bytes are not counted on the CPU; the analytic byte ratio beside it):"))
    if not measured:
        return out + [Paragraph("No cached row recorded both a prefill and a decode time.")]
    return out + [Table(["rows", "batch", "ctx", "bytes ratio (analytic)", "prefill s/token", "decode s/token",
                         "time ratio"], measured, [False] + [True] * 6), Paragraph(
        f"A decoded token took {min(time_ratios):.3g}x to {max(time_ratios):,.3g}x the time of a prefilled one "
        "here. The time ratio stays below the byte ratio where prefill is compute bound rather than "
        "memory bound, and where batching shares decode's weight reads among sequences.")]


def weights_crossover(ref: dict, cohorts: list[Cohort]) -> list[Block]:
    n = ref["tokens_to_match_weights"]
    out = [Heading("How many cached tokens weigh as much as the weights", 3), Paragraph(
        f"{_ref_line(ref)}: weights {fmt.nbytes(ref['weight_bytes'])} ÷ "
        f"{ref['kv_bytes_per_token']:,} B per token = **{n:,.0f} tokens**, in any split of "
        f"batch × tokens: e.g. batch 1 × {n:,.0f}, or batch 32 × {n / 32:,.0f}, or batch 128 × {n / 128:,.0f}.")]
    measured = []
    for g in cohorts:
        crossover = g.figures["tokens_to_match_weights"]
        cached = cached_rows(g.ok).dropna(subset=["kv_cache_bytes"])
        largest = cached.loc[cached["kv_cache_bytes"].idxmax()] if not cached.empty else None
        text = f"{g.title}: analytic crossover at {crossover:,.0f} tokens"
        if largest is not None:
            share = largest["kv_cache_bytes"] / g.figures["weight_bytes"]
            text += (f"; the largest measured cache (batch {largest['batch']} × {largest['ctx'] + largest['decode_tokens']:,} "
                     f"tokens) is {fmt.nbytes(largest['kv_cache_bytes'])}, {share:.2%} of the weights")
        measured.append(text)
    return out + [Paragraph("**Measured:**"), Bullets(measured or ["no rows here"])]


def equal_batch_tokens(ref: dict, cohorts: list[Cohort], sets_by_cohort: dict) -> list[Block]:
    p, few, many, t_few, t_many = (ref[k] for k in ("long_ctx", "few_bytes", "many_bytes", "few_step_s", "many_step_s"))
    out = [Heading("Equal batch × tokens: many short sequences against few long ones", 3), Paragraph(
        f"{_ref_line(ref)}: batch 1 × {p:,} tokens and batch 32 × {p // 32:,} tokens hold the same cache to "
        f"the byte ({ref['long_cache_bytes']:,} B = "
        f"{fmt.nbytes(ref['long_cache_bytes'])}). A step reads the same weights and the "
        f"same cache (totals {fmt.nbytes(few)} and {fmt.nbytes(many)}: they differ only by "
        f"31 embedding rows) and does the same attention work, so the predicted step times are alike "
        f"({fmt.seconds(t_few)} and {fmt.seconds(t_many)}), but the batch-32 step emits 32 tokens, not one: "
        f"**{32 * t_few / t_many:.1f}x the throughput** for the same memory. Memory sets how many tokens can "
        "be held; how they are split sets how many come out per step.")]
    measured = []
    for g in cohorts:
        for product, rows in sets_by_cohort.get(g.slug, []):
            parts = [f"batch {int(r.batch)} × ctx {int(r.ctx)}: {fmt.number(r.tokens_per_s)} tokens/s, "
                     f"step {fmt.seconds(r.decode_step_s)}" for r in rows.itertuples()]
            measured.append(f"{g.model} {g.dtype}, batch × ctx = {product:,}: " + "; ".join(parts))
    return out + [Paragraph("**Measured** (table and plot in the section above):"),
                  Bullets(measured or ["no two rows of one cached strategy share batch × ctx here"])]


def answers(table: pd.DataFrame, cohorts: list[Cohort], sets_by_cohort: dict, analytic) -> list[Block]:
    """Every answer, each built on its own (harness.report.guard): one that fails costs only itself.
    `analytic`: the loader's harness.analysis.curves.AnalyticTables."""
    ref = analytic.example
    out: list[Block] = [
        Heading("What a KV cache buys and costs: the questions, answered"),
        Paragraph(f"Analytic figures are for {_ref_line(ref)}, batch {ref['batch']}, a {ref['ctx']:,}-token prompt "
                  f"and {ref['steps']} decode steps unless stated; measured figures come from the rows above.")]
    for heading, answer in (
            ("Why keys and values can be cached and queries cannot", lambda: cacheable(ref, table)),
            ("Cache bytes per token, for any shape and dtype", lambda: bytes_per_token(ref, cohorts, analytic.published)),
            ("How work grows with length: no cache against cache", lambda: growth(ref, cohorts)),
            ("Why the wall-clock speedup is far below the FLOP saving", lambda: wall_clock_gap(ref, cohorts)),
            ("Prefill against decode: bytes per token", lambda: prefill_decode(ref, cohorts)),
            ("How many cached tokens weigh as much as the weights", lambda: weights_crossover(ref, cohorts)),
            ("Equal batch × tokens: many short sequences against few long ones",
             lambda: equal_batch_tokens(ref, cohorts, sets_by_cohort))):
        out += guard.section(heading, answer, level=3)
    return out
