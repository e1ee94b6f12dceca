"""Conntrack source: dump the kernel's conntrack table (any netns) into Connections."""

from flow_exporter.conntrack.decode import Decoder, DecodeResult, decode_batch
from flow_exporter.conntrack.dumper import ConntrackDumper
from flow_exporter.conntrack.errors import (
    ConntrackDumpInterrupted,
    ConntrackError,
    ConntrackOverrun,
    ConntrackPermissionError,
    ConntrackUnavailable,
    NetnsError,
)
from flow_exporter.conntrack.netns import run_in_netns
from flow_exporter.conntrack.sysctl import enable_accounting, read_sysctl, write_sysctl

__all__ = [
    "ConntrackDumpInterrupted",
    "ConntrackDumper",
    "ConntrackError",
    "ConntrackOverrun",
    "ConntrackPermissionError",
    "ConntrackUnavailable",
    "DecodeResult",
    "Decoder",
    "NetnsError",
    "decode_batch",
    "enable_accounting",
    "read_sysctl",
    "run_in_netns",
    "write_sysctl",
]
