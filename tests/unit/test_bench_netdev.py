"""The /proc/net/dev parser behind the "lo bytes/step" column."""

from __future__ import annotations

import os

import pytest

from benchmarks.harness.netdev import loopback_available, parse_net_dev, read_interface
from zero_ray.errors import ConfigError

SAMPLE = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 123456789   54321    0    0    0     0          0         0 123456789   54321    0    0    0     0       0          0
  eth0:98765432109 1000 2 3 0 0 0 7 1234 56 0 0 0 0 0 0
"""


def test_parses_receive_and_transmit_columns() -> None:
    table = parse_net_dev(SAMPLE)
    assert sorted(table) == ["eth0", "lo"]
    lo = table["lo"]
    assert (lo.rx_bytes, lo.rx_packets, lo.tx_bytes, lo.tx_packets) == (123456789, 54321, 123456789, 54321)


def test_counter_glued_to_the_colon() -> None:
    # The kernel leaves no space after "eth0:" once the counter is wide enough.
    eth = parse_net_dev(SAMPLE)["eth0"]
    assert (eth.rx_bytes, eth.rx_packets, eth.tx_bytes, eth.tx_packets) == (98765432109, 1000, 1234, 56)


def test_blank_lines_are_ignored() -> None:
    assert list(parse_net_dev(SAMPLE + "\n\n")) == ["lo", "eth0"]


@pytest.mark.parametrize("line, match", [
    ("  lo 1 2 3", "no 'iface:'"),
    ("  lo: 1 2 3", "has 3 counters"),
    ("  lo: " + " ".join(["x"] * 16), "non-integer"),
])
def test_malformed_lines_name_the_line(line: str, match: str) -> None:
    text = "\n".join(SAMPLE.splitlines()[:2] + [line])
    with pytest.raises(ConfigError, match=match):
        parse_net_dev(text)


def test_missing_interface_lists_those_present(tmp_path: pytest.TempPathFactory) -> None:
    path = os.path.join(str(tmp_path), "dev")
    with open(path, "w", encoding="ascii") as f:
        f.write(SAMPLE)
    assert read_interface("eth0", path=path).tx_bytes == 1234
    with pytest.raises(ConfigError, match=r"'wlan0' is not in .*\['eth0', 'lo'\]"):
        read_interface("wlan0", path=path)
    assert loopback_available(path) and not loopback_available(path + "-missing")


@pytest.mark.skipif(not os.path.exists("/proc/net/dev"), reason="Linux only")
def test_reads_this_machines_loopback() -> None:
    lo = read_interface("lo")
    assert lo.tx_bytes >= 0 and lo.rx_bytes >= 0
