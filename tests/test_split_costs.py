"""The measured cost model behind split's γ and AS² (edge_runtime/split_costs.py)."""

from __future__ import annotations

import pytest

from edge_runtime.split_costs import SplitCosts


def ort_like(cloud_alone_s: float) -> SplitCosts:
    """Costs as the ORT benchmark measured them: device 40 ms per draft, the cloud verifies
    2/3/5 positions in 85/107/150 ms (about 64 ms at one position), acceptance 0.85."""
    costs = SplitCosts(t_draft=0.040, t_link=0.0015, t_cloud_step=cloud_alone_s)
    costs.accepted, costs.rejected = 8.5, 1.5
    for rows, seconds in ((2, 0.085), (3, 0.107), (5, 0.150)):
        costs.verify.append((rows, seconds))
    return costs


def test_verify_line_estimates_one_position():
    assert ort_like(0.065).verify_time(1) == pytest.approx(0.0635, abs=0.002)


def test_a_stale_slow_cloud_measurement_does_not_make_speculation_look_good():
    # measured right: AS² keeps decoding in the cloud
    assert ort_like(0.065).choose(32).use_cloud_only
    # measured 84 ms once (cold cloud, busy device): the verify line caps it, same decision
    stale = ort_like(0.0836)
    assert stale.cloud_step() == pytest.approx(stale.verify_time(1))
    assert stale.choose(32).use_cloud_only


def test_a_cloud_faster_alone_than_its_verify_line_keeps_its_measurement():
    assert ort_like(0.050).cloud_step() == pytest.approx(0.050)


def test_memory_bound_cloud_still_speculates():
    """torch bf16: verifying 2–5 positions costs about one 320 ms decode step."""
    costs = SplitCosts(t_draft=0.040, t_link=0.02, t_cloud_step=0.32)
    costs.accepted, costs.rejected = 6.5, 3.5
    for rows, seconds in ((2, 0.325), (3, 0.330), (5, 0.345)):
        costs.verify.append((rows, seconds))
    choice = costs.choose(32)
    assert not choice.use_cloud_only and choice.gamma >= 3
