"""Device catalog, unit parsing and the nodes file of ``fusionnet plan --nodes``."""

from __future__ import annotations

import pytest

from fusionnet.errors import PlanError
from fusionnet.perfmodel.catalog import CATALOG, lookup, parse_bytes, parse_flops, parse_rate, parse_seconds
from fusionnet.perfmodel.nodes import load_nodes_file

GiB = 1 << 30


def test_table1_rows_as_in_the_paper():
    expect = {
        "RTX 4090": (82.58, 82.58, 24),
        "RTX 4080": (48.74, 97.5, 16),
        "RTX 3080": (29.77, 59.5, 10),
        "H100": (51.22, 756, 80),
        "A100": (19.49, 155.92, 80),
    }
    for name, (fp32, tensor, mem_gb) in expect.items():
        row = CATALOG[name]
        assert row.fp32_flops == pytest.approx(fp32 * 1e12)
        assert row.tensor_flops == pytest.approx(tensor * 1e12)
        assert row.memory == mem_gb * 10**9
    assert any(r.kind == "cpu" for r in CATALOG.values())
    spec = CATALOG["RTX 3080"].spec(name="x", tensor_cores=False, speed_factor=0.7)
    assert spec.peak_flops == pytest.approx(29.77e12) and spec.speed == pytest.approx(0.7 * 29.77e12)
    assert spec.d_gpu == 10 * 10**9 and spec.d_cpu == 32 * GiB


def test_lookup_is_forgiving_and_helpful():
    assert lookup("nvidia geforce rtx-3080").name == "RTX 3080"
    assert lookup("Tesla V100").name == "V100"
    assert lookup("intel core i9-13900k").name == "Core i9-13900K"
    with pytest.raises(PlanError, match=r"did you mean .*'RTX 3080'"):
        lookup("RTX 3008")


def test_units():
    assert parse_bytes("10GiB") == 10 * GiB
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes(1024) == 1024
    assert parse_rate("1Gbps") == pytest.approx(1.25e8)
    assert parse_rate("125MB/s") == pytest.approx(1.25e8)
    assert parse_rate("1GBps") == pytest.approx(1e9)
    assert parse_seconds("10ms") == pytest.approx(0.01)
    assert parse_seconds("200us") == pytest.approx(2e-4)
    assert parse_seconds(0.5) == 0.5
    assert parse_flops("59.5T") == pytest.approx(59.5e12)
    assert parse_flops("2 TFLOPS") == pytest.approx(2e12)
    with pytest.raises(PlanError, match="unknown unit 'parsecs'"):
        parse_seconds("3 parsecs", "network.latency")
    with pytest.raises(PlanError, match=r"node\.d_gpu: cannot read"):
        parse_bytes("lots", "node.d_gpu")
    with pytest.raises(PlanError, match="positive"):
        parse_rate("0Gbps")
    with pytest.raises(PlanError):
        parse_bytes(True)


NODES = """
nodes:
  - device: RTX 3080
    count: 3
    name: home
    speed_factor: 0.8
  - name: laptop
    kind: cpu
    peak_flops: 1.5T
    mem_bandwidth: 50GB/s
    d_cpu: 16GiB
network:
  latency: 10ms
  bandwidth: 1Gbps
  links:
    - between: [laptop, "home #0"]
      latency: 1ms
      bandwidth: 10Gbps
"""


def test_nodes_file_builds_the_swarm(tmp_path):
    path = tmp_path / "nodes.yaml"
    path.write_text(NODES)
    swarm = load_nodes_file(path)
    assert [d.name for d in swarm.devices] == ["home #0", "home #1", "home #2", "laptop"]
    assert swarm.devices[0].speed == pytest.approx(0.8 * 59.5e12)
    assert (
        swarm.devices[3].kind == "cpu" and swarm.devices[3].d_cpu == 16 * GiB and swarm.devices[3].d_gpu == 0
    )
    assert swarm.default_link.alpha == pytest.approx(0.01) and swarm.default_link.bandwidth == pytest.approx(
        1.25e8
    )
    fast = swarm.link(0, 3)
    assert fast.alpha == pytest.approx(1e-3) and fast.bandwidth == pytest.approx(1.25e9)
    assert swarm.link(1, 2) == swarm.default_link
    bare = tmp_path / "bare.yaml"
    bare.write_text("- device: A100\n")
    assert load_nodes_file(bare).devices[0].name == "A100"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes:\n  - device: RTX 9999\n", r"nodes\[0\].*not in the catalog"),
        ("nodes:\n  - device: H100\n    spead_factor: 1\n", r"nodes\[0\]: unknown key\(s\) 'spead_factor'"),
        (
            "nodes:\n  - device: H100\n  - name: x\n    kind: cpu\n",
            r"nodes\[1\]: .*missing peak_flops, mem_bandwidth, d_cpu",
        ),
        ("nodes:\n  - device: H100\n    count: 0\n", r"nodes\[0\]\.count"),
        ("nodes:\n  - device: H100\n  - device: H100\n", "two nodes are named 'H100'"),
        ("nodes:\n  - device: H100\n    d_gpu: lots\n", r"nodes\[0\]\.d_gpu: cannot read"),
        ("nodes: []\n", "non-empty list"),
        ("nodes:\n  - device: H100\nnetwork:\n  latency: 1 fortnight\n", "network.latency: unknown unit"),
        (
            "nodes:\n  - device: H100\nnetwork:\n  links:\n    - between: [H100, ghost]\n",
            r"links\[0\]\.between names unknown node 'ghost'",
        ),
        ("nodes:\n  - device: H100\nextra: 1\n", "unknown key"),
        ("nodes: [\n", "not valid YAML"),
        (
            "nodes:\n  - name: g\n    kind: gpu\n    peak_flops: 1T\n"
            "    mem_bandwidth: 1GB/s\n    d_cpu: 1GiB\n",
            "missing d_gpu",
        ),
        (
            "nodes:\n  - name: g\n    kind: tpu\n    peak_flops: 1T\n"
            "    mem_bandwidth: 1GB/s\n    d_cpu: 1GiB\n",
            r"nodes\[0\]: .*kind 'tpu'",
        ),
    ],
)
def test_nodes_file_errors_name_the_entry(tmp_path, text, message):
    path = tmp_path / "nodes.yaml"
    path.write_text(text)
    with pytest.raises(PlanError, match=message) as info:
        load_nodes_file(path)
    assert str(path) in str(info.value)


def test_missing_nodes_file(tmp_path):
    with pytest.raises(PlanError, match="cannot read nodes file"):
        load_nodes_file(tmp_path / "absent.yaml")
