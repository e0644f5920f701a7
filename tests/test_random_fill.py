"""Seeded parallel fill (harness.model.random_fill): same values for the same seed whatever the thread count,
every element written exactly once, the requested standard deviation."""
from __future__ import annotations

import math

import torch

from harness.model import random_fill
from harness.model.random_fill import uniform_like_normal_


def filled(shape, threads: int, seed: int = 0, std: float = 0.5) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return uniform_like_normal_(torch.empty(shape), std, torch.Generator().manual_seed(seed))
    finally:
        torch.set_num_threads(before)


def test_values_depend_on_the_seed_not_on_the_threads(monkeypatch):
    monkeypatch.setattr(random_fill, "PIECE_ELEMENTS", 1000)  # many pieces, so the pool is used
    one, two = filled((300, 70), threads=1), filled((300, 70), threads=2)
    assert torch.equal(one, two)
    assert not torch.equal(one, filled((300, 70), threads=2, seed=1))


def test_mean_and_standard_deviation(monkeypatch):
    monkeypatch.setattr(random_fill, "PIECE_ELEMENTS", 4096)
    values = filled((512, 512), threads=2, std=0.5)
    assert abs(values.mean().item()) < 0.01 and abs(values.std().item() - 0.5) < 0.01
    assert values.abs().max().item() <= 0.5 * math.sqrt(3) + 1e-6


def test_a_strided_view_is_covered_exactly_and_nothing_outside_it(monkeypatch):
    """fill_random fills a cache table narrowed to its filled prefix: a non-contiguous view."""
    monkeypatch.setattr(random_fill, "PIECE_ELEMENTS", 64)
    table = torch.full((2, 3, 40, 8), float("nan"))  # [B, n_kv, S, D]
    uniform_like_normal_(table.narrow(2, 0, 25), 1.0, torch.Generator().manual_seed(0))
    assert not table[:, :, :25].isnan().any() and table[:, :, 25:].isnan().all()
    assert table[:, :, :25].unique().numel() == table[:, :, :25].numel()  # no piece filled twice alike
