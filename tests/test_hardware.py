import copy
from pathlib import Path

import pytest
import yaml

from vsim.errors import HardwareError
from vsim.hardware import list_hardware, load_hardware, parse_hardware

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p.stem for p in (ROOT / "hardware").glob("*.yaml"))


def test_required_profiles_are_shipped():
    for name in ("titan-x-maxwell", "h100-sxm", "h200", "k40", "titan-xp", "v100-16gb",
                 "a100-40gb"):
        assert name in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads_with_provenance(name):
    hw = load_hardware(name)
    assert hw.name == name
    assert hw.provenance["source"] and hw.provenance["date"] and hw.provenance["method"]
    assert 0 < hw.context_bytes < hw.memory_bytes
    assert hw.h2d.pinned.bandwidth_bytes_per_us > hw.h2d.pageable.bandwidth_bytes_per_us * 0.5


def test_titan_x_matches_the_paper():
    hw = load_hardware("titan-x-maxwell")
    assert hw.memory_bytes == 12 * 2**30
    assert hw.dram_bytes_per_us == pytest.approx(336e3)   # 336 GB/s
    assert hw.h2d.pinned.bandwidth_bytes_per_us == pytest.approx(12.8e3)  # 12.8 GB/s
    # 1 GiB at 12.8 GB/s plus 10 us latency: 2**30 / 12800 + 10 = 83896.08 us
    assert hw.h2d.copy_time_us(2**30) == pytest.approx(2**30 / 12800 + 10)


def test_efficiency_table_interpolates_in_log_size():
    doc = _doc()
    doc["link"]["h2d"]["pinned"] = {
        "bandwidth": "50GB/s", "latency": "10us",
        "efficiency": [{"size": "1MiB", "fraction": "40%"}, {"size": "16MiB", "fraction": "90%"}]}
    path = parse_hardware(doc, "t.yaml").h2d.pinned
    # 4 MiB is halfway from 1 to 16 MiB in log2 (2 of 4 doublings): 40% + 0.5 * 50% = 65%.
    assert path.efficiency_at(4 * 2**20) == pytest.approx(0.65)
    assert path.efficiency_at(1) == pytest.approx(0.40)        # flat below the table
    assert path.efficiency_at(2**40) == pytest.approx(0.90)    # flat above it
    # 4 MiB: 10 us + 4194304 B / (50000 B/us * 0.65) = 10 + 129.055 us
    assert path.copy_time_us(4 * 2**20) == pytest.approx(10 + 4 * 2**20 / (50_000 * 0.65))
    assert path.copy_time_us(0) == 0.0


def _doc(name="h100-sxm"):
    return yaml.safe_load((ROOT / "hardware" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("path,value,message", [
    (("gpu", "memory"), 12, "with a unit"),
    (("gpu", "memory"), "12 apples", "unknown size unit"),
    (("link", "h2d", "pinned", "bandwidth"), "0GB/s", "above zero"),
    (("link", "duplex"), "90", "without a unit"),
    (("compute", "copy_interference"), 0.05, "percentage"),
    (("gpu", "context"), "100GiB", "below gpu.memory"),
])
def test_bad_profiles_name_the_key(path, value, message):
    doc = copy.deepcopy(_doc())
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(HardwareError) as err:
        parse_hardware(doc, "bad.yaml")
    text = str(err.value)
    assert text.startswith("bad.yaml: ") and message in text
    if path[-1] not in ("context",):
        assert ".".join(path) in text


def test_missing_provenance_is_an_error():
    doc = _doc()
    del doc["provenance"]["method"]
    with pytest.raises(HardwareError, match="provenance"):
        parse_hardware(doc, "x.yaml")


def test_unknown_name_lists_known_profiles():
    with pytest.raises(HardwareError, match="h100-sxm"):
        load_hardware("no-such-gpu")
    assert "h200" in list_hardware()


def test_launch_latency_and_cuda_malloc_are_informational():
    """Old profiles keep loading with them, new ones may leave them out (nothing reads them:
    docs/design.md), and a bad value is still an error naming the key."""
    doc = _doc()
    with_them = parse_hardware(doc, "x.yaml")
    del doc["compute"]["launch_latency"], doc["gpu"]["cuda_malloc"]
    assert parse_hardware(doc, "x.yaml") == with_them
    doc["gpu"]["cuda_malloc"] = "80"
    with pytest.raises(HardwareError, match="gpu.cuda_malloc"):
        parse_hardware(doc, "x.yaml")
