"""Which source the runner reads (conntrack.source), what it tells the store, and which state it continues."""

from __future__ import annotations

from pathlib import Path

import pytest

from flow_exporter.config import load
from flow_exporter.flow import BOTH_DIRECTIONS
from flow_exporter.runner import chosen_source, options_from, table_name


def cfg(**over: object):  # type: ignore[no-untyped-def]
    return load(None, environ={}, overrides=over)


def test_auto_reads_cilium_where_its_maps_are_pinned(tmp_path: Path) -> None:
    assert chosen_source(cfg(**{"conntrack.source": "auto", "cilium.bpffs": str(tmp_path)})) == "netfilter"
    (tmp_path / "tc" / "globals").mkdir(parents=True)
    (tmp_path / "tc" / "globals" / "cilium_ct_any4_global").touch()  # not the TCP map: not Cilium's table yet
    assert chosen_source(cfg(**{"conntrack.source": "auto", "cilium.bpffs": str(tmp_path)})) == "netfilter"
    (tmp_path / "tc" / "globals" / "cilium_ct4_global").touch()
    assert chosen_source(cfg(**{"conntrack.source": "auto", "cilium.bpffs": str(tmp_path)})) == "cilium"
    assert chosen_source(cfg(**{"conntrack.source": "netfilter", "cilium.bpffs": str(tmp_path)})) == "netfilter"
    assert chosen_source(cfg(**{"conntrack.source": "cilium", "cilium.bpffs": "/nonexistent"})) == "cilium"


@pytest.mark.parametrize(
    ("source", "counters", "flags"),
    [("cilium", "combined", BOTH_DIRECTIONS), ("cilium", "split", 0), ("netfilter", "combined", 0)],
)
def test_only_combined_cilium_counters_flag_every_record(source: str, counters: str, flags: int) -> None:
    o = options_from(cfg(**{"cilium.counters": counters}), adopt=False, source=source)
    assert (o.source_flags, o.source) == (flags, source)


def test_a_state_directory_continues_only_the_table_it_was_written_from() -> None:
    """The checkpoint names its table: another source (or another bpffs, or netns) starts a new lineage."""
    names = {
        table_name(cfg(), "netfilter"),
        table_name(cfg(**{"conntrack.netns": "lab"}), "netfilter"),
        table_name(cfg(), "cilium"),
        table_name(cfg(**{"cilium.bpffs": "/run/cilium/bpffs"}), "cilium"),
    }
    assert len(names) == 4
