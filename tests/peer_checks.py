"""Checks every engine member's tests share (tests/test_openvino.py; the other engines' tests may use them)."""
from __future__ import annotations

import pytest


def aa_pair_ratio(point, reference_point):
    """Two identical members of one group and the group's reference: the second member's paired step
    ratio to the first (if the engine's threads spun while the other ran, the second of each pair would
    pay for it). Skips, naming the noise, where the machine was busy while the pair ran."""
    from harness.measure.contention import noise_reasons
    from harness.measure.group import GroupRequest, measure_group
    from harness.measure.intervals import paired_ratio

    first, second, _ = measure_group(GroupRequest("aa", (point, point, reference_point)))
    assert first["status"] == second["status"] == "ok", (first["reason"], second["reason"])
    noise = ["; ".join(reasons) for row in (first, second)
             if (reasons := noise_reasons(row["contention"], row["decode_step_p10_s"], row["decode_step_p90_s"], {}))]
    if noise:  # a busy machine moves either member by more than a spinning pool would: no verdict
        pytest.skip(f"the machine was busy while the pair ran: {'; '.join(noise)}")
    return paired_ratio(second["decode_step_times_s"], first["decode_step_times_s"])
