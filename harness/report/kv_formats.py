"""The section "what fewer bytes buy": for each cache that stores fewer bits per value (a quantized
format, read from the rows' cache_value_bits), its bytes per token, its step-time speedup over the
plain exact cache at the same points (measured and predicted), and how far it moved the outputs
(the accuracy columns, measured against an exact reference; with a prompt file, the perplexity of
its text through both); one plot of speedup against accuracy. Each group says where its accuracy came
from: seeded random weights, which do not predict a real model's, or a checkpoint's.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from harness.analysis import analytic  # noqa: E402
from harness.analysis.results import SERIES  # noqa: E402
from harness.report import units as fmt  # noqa: E402
from harness.report.document import Block, Figure, Heading, Paragraph, Table  # noqa: E402
from harness.report.cohorts import Cohort, cached_rows, plain_cache_strategy  # noqa: E402
from harness.report.plots import DPI, MARKERS, log_scale  # noqa: E402
from harness.report.verdicts import Comparison, compare  # noqa: E402

HEADER = ["series", "batch", "ctx", "bytes/token", "× plain cache bytes", "speedup measured", "speedup predicted",
          "top-1 agreement", "KL mean (nats)", "max |Δlogit|", "perplexity exact → cache"]
RANDOM_WEIGHTS_WARNING = (
    "Random weights do not predict real accuracy: a real model's keys carry a few outlier channels, which "
    "per-token scales quantize worst (the reason KIVI scales keys per channel), and random keys have none. "
    "Judge a format on a checkpoint and real text: `model.checkpoint=PATH prompt=PATH` (docs/method.md).")


def ran_rows(group: Cohort) -> pd.DataFrame:
    """Rows that ran, noisy ones included: a noisy row's accuracy columns do not depend on the machine's
    load, only its times do (comparisons leaves those out)."""
    return group.rows[group.rows["status"] == "ok"].dropna(subset=["decode_step_s"])


def noisy(row: pd.Series) -> bool:
    return bool(row.get("noisy")) if not pd.isna(row.get("noisy")) else False


def narrow_rows(group: Cohort) -> pd.DataFrame:
    """Rows that ran of caches stored below the compute dtype's width."""
    cached = cached_rows(ran_rows(group))
    return cached[cached["cache_value_bits"].fillna(0) > 0] if "cache_value_bits" in cached else cached.iloc[0:0]


def comparisons(group: Cohort) -> list[dict]:
    """One dict per narrow row that has a plain-cache row at the same batch and ctx; the measured speedup
    is None where either row is noisy."""
    ran = ran_rows(group)
    plain_name = plain_cache_strategy(ran)
    if plain_name is None:
        return []
    plain = ran[ran[SERIES] == plain_name].set_index(["batch", "ctx"])
    plain_per_token = analytic.kv_bytes_per_token(group.shape, group.dtype, group.layouts[plain_name])
    found = []
    for _, row in narrow_rows(group).iterrows():
        key = (row["batch"], row["ctx"])
        if key not in plain.index:
            continue
        reference = plain.loc[key]
        reference = reference.iloc[0] if isinstance(reference, pd.DataFrame) else reference
        per_token = analytic.kv_bytes_per_token(group.shape, group.dtype, group.layouts[row[SERIES]])
        found.append({
            "series": row[SERIES], "batch": int(row["batch"]), "ctx": int(row["ctx"]),
            "bytes_per_token": per_token, "bytes_ratio": per_token / plain_per_token,
            "measured": None if noisy(row) or noisy(reference) else speedup(ran, plain_name, row),
            "predicted": reference["analytic_decode_step_s"] / row["analytic_decode_step_s"],
            "top1": row.get("top1_agreement"), "kl": row.get("logit_kl_mean"), "max_abs": row.get("logit_max_abs_error"),
            "perplexity": row.get("perplexity"), "perplexity_reference": row.get("perplexity_reference"),
        })
    return found


def speedup(ran: pd.DataFrame, plain_name: str, row) -> Comparison:
    """The plain cache's step over this row's at its point (above 1: the narrow cache is faster),
    round by round where the two were timed together (harness.report.verdicts.compare)."""
    at_point = ran[(ran["batch"] == row["batch"]) & (ran["ctx"] == row["ctx"])]
    return compare(at_point[at_point[SERIES] == plain_name], at_point[at_point[SERIES] == row[SERIES]])


def perplexity_text(found: dict) -> str:
    """"exact → cache (+delta)", or a dash where no prompt file gave text to score."""
    cache, exact = found["perplexity"], found["perplexity_reference"]
    if pd.isna(cache) or pd.isna(exact):
        return "–"
    return f"{exact:.4g} → {cache:.4g} ({cache - exact:+.3g})"


def weights_note(group: Cohort) -> str:
    """Where the group's accuracy figures came from: random weights (with the warning), a checkpoint
    (its folder and hash) and the prompt (a file, or random ids)."""
    rows = narrow_rows(group)
    weights = rows["weights"].fillna("random") if "weights" in rows else pd.Series("random", index=rows.index)
    parts = []
    if (weights == "checkpoint").any():
        checkpoints = rows.loc[weights == "checkpoint", ["checkpoint", "checkpoint_hash"]].drop_duplicates()
        parts.append("Accuracy from a checkpoint's weights: " + ", ".join(
            f"`{c.checkpoint}` (hash {c.checkpoint_hash})" for c in checkpoints.itertuples()) + ".")
    if (weights == "random").any():
        parts.append(("Some of these rows have" if parts else "Accuracy from") + " seeded random weights. "
                     + RANDOM_WEIGHTS_WARNING)
    prompts = rows["prompt"].dropna().unique() if "prompt" in rows else []
    parts.append(f"Prompts and scored text from {', '.join(f'`{p}`' for p in prompts)}." if len(prompts) else
                 "Prompts were seeded random token ids, so no perplexity was measured.")
    return " ".join(parts)


def speedup_against_accuracy(group: Cohort, found: list[dict], folder: Path) -> Path | None:
    measured = [f for f in found if not pd.isna(f["kl"]) and f["measured"] is not None]
    if not measured:
        return None
    fig, ax = plt.subplots(figsize=(8.0, 4.8))
    for i, series in enumerate(sorted({f["series"] for f in measured})):
        mine = [f for f in measured if f["series"] == series]
        ax.plot([f["measured"].ratio.median for f in mine], [max(f["kl"], 1e-12) for f in mine], MARKERS[i % len(MARKERS)],
                ms=8, label=series)
    ax.axvline(1.0, color="#999", lw=0.8)
    log_scale(ax, "y", lambda kl: f"{kl:g}")
    ax.set_xlabel("decode step speedup over the plain exact cache (measured)")
    ax.set_ylabel("mean KL(reference || cache), nats")
    ax.set_title(f"What fewer bytes buy, and what they cost\n{group.title}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(folder) / f"speedup_vs_accuracy_{group.slug}.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def format_section(groups: list[Cohort], folder: Path) -> list[Block]:
    out: list[Block] = [Heading("What fewer bytes buy"), Paragraph(
        "Caches that store K/V below the compute dtype's width, at every point where the plain exact cache "
        "also ran: bytes per token (payload, scales and the full-width window, analytic), the step-time "
        "speedup over the plain cache, measured and predicted (the roofline's, from each layout's bytes), "
        "and how far the outputs moved: top-1 agreement, mean KL and the largest logit error over teacher-"
        "forced steps against the exact reference (null with prefill=random, which runs no prompt), and with a "
        "prompt file the perplexity of its text through the exact reference and through the cache.")]
    shown = False
    for group in groups:
        found = comparisons(group)
        if not found:
            continue
        shown = True
        body = [[f["series"], fmt.count(f["batch"]), fmt.count(f["ctx"]), fmt.nbytes(f["bytes_per_token"]),
                 fmt.ratio(f["bytes_ratio"]), "noisy" if f["measured"] is None else f["measured"].text(),
                 fmt.ratio(f["predicted"]),
                 "–" if pd.isna(f["top1"]) else f"{f['top1']:.3f}", "–" if pd.isna(f["kl"]) else f"{f['kl']:.3g}",
                 "–" if pd.isna(f["max_abs"]) else f"{f['max_abs']:.3g}", perplexity_text(f)] for f in found]
        out += [Heading(group.title, 3), Paragraph(weights_note(group)), Table(HEADER, body, [False] + [True] * 10)]
        path = speedup_against_accuracy(group, found, folder)
        if path is not None:
            out.append(Figure(path, "Each point: a quantized cache at one batch × ctx. Right is faster than the exact "
                                    "cache; down is closer to its outputs."))
    if not shown:
        out.append(Paragraph("No quantized cache ran beside the plain cache here, e.g. "
                             "`python -m harness.run -m strategy=quantized strategy.format=int8,int4,fp8_e4m3` and "
                             "`strategy=contiguous` at the same batch and ctx."))
    return out
