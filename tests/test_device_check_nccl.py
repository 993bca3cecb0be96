"""scripts/device_check.py's verdicts that need no GPU: which network NCCL's log says it uses, which RDMA
devices of a node are EFA, when an EFA node's NCCL falls back to sockets (aws-ofi-nccl not loaded: silent
TCP), and when reserved CUDA memory climbs across weight syncs (a leak like vLLM #52950). The sections
that call them run on a GPU machine only (bash scripts/device_check.sh)."""

from __future__ import annotations

import os

from stand_ins import REPO, load_module

dc = load_module(REPO / "scripts" / "device_check.py", "device_check_under_test")

SOCKET_LOG = """node-1:123:123 [0] NCCL INFO Bootstrap: Using eth0:10.0.0.5<0>
node-1:123:123 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal net plugin.
node-1:123:123 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>
node-1:123:123 [0] NCCL INFO Using network Socket
"""
OFI_LOG = """node-1:123:123 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v9)
node-1:123:123 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)
node-1:123:123 [0] NCCL INFO Using network Libfabric
"""


def fake_sys(tmp_path, drivers: dict[str, str]):
    """A /sys/class/infiniband look-alike: device NAME whose device/driver links to a folder named DRIVER."""
    root = tmp_path / "infiniband"
    for name, driver in drivers.items():
        (tmp_path / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (root / name / "device").mkdir(parents=True)
        os.symlink(tmp_path / "drivers" / driver, root / name / "device" / "driver")
    return root


def test_the_network_nccl_names_is_read_from_its_log():
    assert dc.nccl_network(SOCKET_LOG) == "Socket"
    assert dc.nccl_network(OFI_LOG) == "Libfabric"
    assert dc.nccl_network("NCCL INFO Bootstrap: Using eth0\n") is None


def test_efa_devices_are_found_by_their_driver(tmp_path):
    root = fake_sys(tmp_path, {"rdmap16s27": "efa", "rdmap32s27": "efa", "mlx5_0": "mlx5_core"})
    assert dc.efa_devices(root) == ["rdmap16s27", "rdmap32s27"]
    assert dc.efa_devices(tmp_path / "absent") == []


def test_an_efa_node_falling_back_to_sockets_fails_naming_the_fix():
    problem = dc.nccl_net_problem("Socket", ["rdmap16s27"])
    assert "EFA (rdmap16s27) but NCCL uses Socket" in problem and "LD_LIBRARY_PATH" in problem
    assert dc.nccl_net_problem("Libfabric", ["rdmap16s27"]) is None
    assert dc.nccl_net_problem("Socket", []) is None  # no EFA: sockets is all there is
    assert "network it uses is unknown" in dc.nccl_net_problem(None, ["rdmap16s27"])
    assert dc.nccl_net_problem(None, []) is None


def test_reserved_memory_climbing_across_syncs_is_a_leak():
    gib = 2**30
    leak = [10 * gib + i * 2 * gib for i in range(8)]  # vLLM #52950: +2 GiB per sync
    assert dc.reserved_growth_per_push(leak) == 2 * gib > dc.RESERVED_GROWTH_LIMIT_BYTES
    flat = [10 * gib, 10 * gib + 2**20, 10 * gib, 10 * gib + 2**20]  # allocator jitter
    assert dc.reserved_growth_per_push(flat) < dc.RESERVED_GROWTH_LIMIT_BYTES
    assert dc.reserved_growth_per_push([gib]) == 0.0
