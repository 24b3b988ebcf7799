"""The failure model against the public figures it is calibrated on."""

from __future__ import annotations

import math

import pytest

from leto.sim import calibration
from leto.sim.calibration import FailureClass


def test_packaged_table_is_the_llama3_table() -> None:
    cats = calibration.load_categories()
    assert len(cats) == 18
    assert sum(c.count for c in cats) == calibration.LLAMA3_UNEXPECTED == 419
    assert {c.name for c in cats} == set(calibration.DEFAULT_CLASS)


def test_default_classes_and_hof_fraction() -> None:
    shares = calibration.class_shares(calibration.load_categories())
    assert sum(shares) == pytest.approx(1.0)
    # In place by default: software bug 54, network switch or cable 35, NCCL watchdog 7,
    # dependency 2.
    assert shares[FailureClass.IN_PLACE] == pytest.approx(98 / 419)
    assert shares[FailureClass.DEVICE_MEMORY] == pytest.approx((72 + 19 + 17) / 419)
    assert shares[FailureClass.NODE_LOSS] == pytest.approx(32 / 419)
    assert shares[FailureClass.REPLACEMENT] == pytest.approx(181 / 419)


def test_hof_fraction_rescales_the_rest_in_proportion() -> None:
    shares = calibration.class_shares(calibration.load_categories())
    new = calibration.with_hof_fraction(shares, 0.6)
    assert new[0] == 0.6 and sum(new) == pytest.approx(1.0)
    assert new[1] / new[3] == pytest.approx(shares[1] / shares[3])
    for bad in (-0.01, 1.01, math.nan):
        with pytest.raises(ValueError, match="HOF fraction"):
            calibration.with_hof_fraction(shares, bad)


def test_meta_curve_passes_through_its_published_points() -> None:
    for gpus, hours in calibration.META_MTTF_H:
        assert calibration.meta_mttf_hours(gpus) == pytest.approx(hours)
    # Interpolated and extrapolated monotonically: more GPUs, more failures.
    sizes = [6, 72, 1024, 4096, 16_384, 65_536, 131_072, 262_144]
    mttf = [calibration.meta_mttf_hours(n) for n in sizes]
    assert all(a > b for a, b in zip(mttf, mttf[1:], strict=False))
    with pytest.raises(ValueError):
        calibration.meta_mttf_hours(0)


def test_llama3_calibration_level_and_meta_shape() -> None:
    assert calibration.job_mtbf_hours(16_384, "llama3") == pytest.approx(54 * 24 / 419)
    ratio = calibration.job_mtbf_hours(131_072, "llama3") / calibration.job_mtbf_hours(
        16_384, "llama3"
    )
    assert ratio == pytest.approx((14 / 60) / 1.8)
    assert calibration.job_mtbf_hours(131_072, "meta") == pytest.approx(14 / 60)
    with pytest.raises(ValueError, match="calibration"):
        calibration.job_mtbf_hours(1024, "nope")
