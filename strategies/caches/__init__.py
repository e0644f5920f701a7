"""Caches: strategies that run inside the harness's own decoder (harness.model.decoder), one file each.

A cache is a `strategies.base.LayerCache` per layer: the decoder hands it each layer's roped queries
and new keys and values, and it decides what is stored and what is read (nothing, a preallocated
table, pages, quantized slots, a budget of kept tokens, pruned key channels). Its attention kernels
are declared as data (strategies.backends); the CPU ones come from the one extension of
harness.kernels. The modules without a strategy are what several caches share: `attention` (SDPA over
grouped queries), `cpu_kernel` (the contiguous C kernel), `quantization` (the stored formats).

Nothing here imports strategies.engines (an import-linter contract in pyproject.toml).
"""
