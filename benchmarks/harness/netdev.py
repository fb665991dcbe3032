"""Byte counters of network interfaces from ``/proc/net/dev`` (Linux).

The benchmark uses the loopback interface as an independent count of what a system sends: on
one machine gloo's TCP connections run over ``lo`` even when they address the host's own
external IP (the kernel routes local addresses through the loopback device). The counter is
per network namespace, so it also counts Ray's own control traffic and anything else local on
the machine; take deltas around the timed steps only.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_ray.errors import ConfigError

NET_DEV = "/proc/net/dev"

# The column order of /proc/net/dev after "iface:": 8 receive counters, then 8 transmit.
_FIELDS = ("bytes", "packets", "errs", "drop", "fifo", "frame", "compressed", "multicast")


@dataclass(frozen=True, kw_only=True)
class InterfaceCounters:
    """Cumulative receive/transmit byte and packet counts of one interface."""

    name: str
    rx_bytes: int
    rx_packets: int
    tx_bytes: int
    tx_packets: int

    def __post_init__(self) -> None:
        for field in ("rx_bytes", "rx_packets", "tx_bytes", "tx_packets"):
            if getattr(self, field) < 0:
                raise ConfigError(f"{self.name}: {field}={getattr(self, field)} must be >= 0")


def parse_net_dev(text: str) -> dict[str, InterfaceCounters]:
    """Parse the contents of ``/proc/net/dev`` into counters by interface name.

    The first two lines are headers. Each further line is ``iface: 16 numbers``; the kernel
    pads the name with spaces and, for long counters, may leave no space after the colon, so
    the line is split at the colon rather than on whitespace.
    """
    out: dict[str, InterfaceCounters] = {}
    for lineno, line in enumerate(text.splitlines()[2:], start=3):
        if not line.strip():
            continue
        name, sep, rest = line.partition(":")
        if not sep:
            raise ConfigError(f"{NET_DEV} line {lineno} has no 'iface:' prefix: {line!r}")
        values = rest.split()
        if len(values) < 2 * len(_FIELDS):
            raise ConfigError(f"{NET_DEV} line {lineno} has {len(values)} counters, expected {2 * len(_FIELDS)}: {line!r}")
        try:
            numbers = [int(v) for v in values]
        except ValueError as err:
            raise ConfigError(f"{NET_DEV} line {lineno} has a non-integer counter: {line!r}") from err
        tx = len(_FIELDS)
        name = name.strip()
        out[name] = InterfaceCounters(name=name, rx_bytes=numbers[0], rx_packets=numbers[1],
                                      tx_bytes=numbers[tx], tx_packets=numbers[tx + 1])
    return out


def read_interface(name: str = "lo", *, path: str = NET_DEV) -> InterfaceCounters:
    """The current counters of interface ``name``; ConfigError naming the interfaces present
    when it is missing (OSError when ``path`` cannot be read, e.g. not on Linux)."""
    with open(path, encoding="ascii") as f:
        table = parse_net_dev(f.read())
    if name not in table:
        raise ConfigError(f"interface {name!r} is not in {path}; present: {sorted(table)}")
    return table[name]


def loopback_available(path: str = NET_DEV) -> bool:
    """Whether the loopback counters can be read here."""
    try:
        read_interface("lo", path=path)
    except (OSError, ConfigError):
        return False
    return True
