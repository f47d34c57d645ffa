import math

import pytest

from vsim.errors import UnitError
from vsim.units import format_size, format_time, parse_flops, parse_rate, parse_size, parse_time


@pytest.mark.parametrize("text,expected", [
    ("12GiB", 12 * 2**30), ("12 GB", 12 * 10**9), ("512MiB", 512 * 2**20), ("1.5KiB", 1536),
    ("0B", 0), ("3TB", 3 * 10**12),
])
def test_sizes_binary_and_decimal(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text,expected_us", [("9us", 9.0), ("1.5ms", 1500.0), ("2s", 2e6),
                                              ("500ns", 0.5)])
def test_times_in_microseconds(text, expected_us):
    assert parse_time(text) == pytest.approx(expected_us)


def test_rates_in_bytes_per_microsecond():
    # 12.8 GB/s = 12.8e9 B / 1e6 us = 12800 B/us
    assert parse_rate("12.8GB/s") == pytest.approx(12800.0)
    assert parse_rate("1GiB/s") == pytest.approx(2**30 / 1e6)
    # 7 TFLOP/s = 7e12 / 1e6 = 7e6 flops per us
    assert parse_flops("7TFLOP/s") == pytest.approx(7e6)


@pytest.mark.parametrize("bad", ["12", 12, None, "12 parsecs", "GiB", "-1GiB", "nanGiB", True,
                                 "1e999GiB"])
def test_bad_sizes_are_errors_naming_the_place(bad):
    with pytest.raises(UnitError) as err:
        parse_size(bad, "profile.yaml: gpu.memory")
    assert "profile.yaml: gpu.memory" in str(err.value)


def test_bare_number_error_suggests_a_unit():
    with pytest.raises(UnitError, match="without a unit.*GiB"):
        parse_size("12")


def test_formatting():
    assert format_size(1536) == "1.50 KiB"
    assert format_size(12 * 2**30) == "12.00 GiB"
    assert format_time(1500.0) == "1.50 ms"
    assert format_time(2.5e6) == "2.500 s"
    assert not math.isnan(parse_rate("0.5MB/s"))
