"""Stage 6 of the pipeline: every measured row beside its analytic prediction, and the questions a KV
cache raises answered with this machine's numbers.

    python -m harness.report results_dir=results [hardware=h100_sxm] [out=<folder>]

writes <results_dir>/_report/report.md and a self-contained index.html (plots embedded). Modules:
assemble (the sections in order, the files written), guard (a fault costs only its section or plot),
cohorts (rows per model/device/dtype), document (blocks, Markdown), html (HTML), units (numbers),
figures (how every plot is laid out), plots, tables, summary and verdicts (the first screen, what the
intervals support), layouts (which layout wins where), tradeoff and kv_formats (what fewer bytes buy),
overhead (beyond the roofline, eager against compiled), questions (the answers), compare (a baseline).
"""
