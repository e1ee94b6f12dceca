"""Completeness markers' bookkeeping with plain values (flow_exporter.completeness)."""

from __future__ import annotations

import io

import fastavro

from flow_exporter.completeness import Completeness, Losses, encode_marker, marker_schema


def test_up_to_is_the_oldest_unacknowledged_export_time() -> None:
    c = Completeness("flows", started_ms=1_000)
    (m,), _ = c.markers("n", 1_500, Losses())
    assert (m["partition"], m["since"], m["until"], m["upTo"], m["lastOffset"]) == (-1, 1_000, 1_500, 1_500, -1)
    c.produced(1, 1_600)
    c.produced(2, 1_700)
    c.produced(1, 1_900)  # a resend keeps its first export time
    c.settled(2, partition=0, offset=41)
    (m,), _ = c.markers("n", 2_000, Losses())
    assert m["upTo"] == 1_600 and m["recordsAcknowledged"] == 1 and m["lastOffset"] == 41
    c.settled(1)  # given up for good: no longer holds upTo back, counted nowhere as acknowledged
    (m,), _ = c.markers("n", 2_100, Losses())
    assert m["upTo"] == 2_100 and m["partition"] == 0 and m["recordsAcknowledged"] == 1


def test_counts_carry_over_until_a_round_is_confirmed() -> None:
    c = Completeness("flows", started_ms=0)
    for key, part in ((1, 0), (2, 0), (3, 1)):
        c.produced(key, 10)
        c.settled(key, partition=part, offset=key)
    first, until = c.markers("n", 100, Losses(event_losses=5))
    assert [(m["partition"], m["recordsAcknowledged"], m["eventLosses"]) for m in first] == [(0, 2, 5), (1, 1, 5)]
    # The round was lost: the next covers the same interval again, with everything since.
    c.produced(4, 150)
    c.settled(4, partition=1, offset=9)
    second, until2 = c.markers("n", 200, Losses(event_losses=7))
    assert [(m["since"], m["recordsAcknowledged"], m["eventLosses"]) for m in second] == [(0, 2, 7), (0, 2, 7)]
    c.confirmed(until2, Losses(event_losses=7))
    c.produced(5, 250)
    c.settled(5, partition=0, offset=11)
    third, _ = c.markers("n", 300, Losses(event_losses=7, records_given_up=1))
    assert [(m["since"], m["recordsAcknowledged"], m["eventLosses"], m["recordsGivenUp"]) for m in third] == [
        (200, 1, 0, 1),
        (200, 0, 0, 1),
    ]
    c.confirmed(until, Losses(event_losses=5))  # a late confirmation of an older round changes nothing
    assert c.markers("n", 400, Losses(event_losses=7, records_given_up=1))[0][0]["since"] == 200


def test_markers_encode_with_their_schema() -> None:
    c = Completeness("flows", started_ms=0)
    markers, _ = c.markers("node-a", 5, Losses(1, 2, 3))
    value = encode_marker(markers[0])
    decoded = fastavro.schemaless_reader(io.BytesIO(value), marker_schema(), marker_schema())
    for name in ("since", "until", "upTo"):  # timestamp-millis come back as datetimes
        decoded[name] = round(decoded[name].timestamp() * 1000)
    assert decoded == markers[0]
