"""The state directory on a disk that fills up, and on a volume that turns read-only (issue 22, items 3 and 6).

The real exporter process, lab traffic, kernel conntrack and a real broker, with ``state.dir`` on a
small file system of the test's own. Whatever happens to the disk, the records read back must keep
the contract (no (connectionId, sequence) pair with two contents, no gaps, deltas that add up), each
connection must keep one connectionId across a SIGKILL and a restart (nothing restarted under a new
lineage), and the consumer rule must give ``conntrack -L``'s totals, connection by connection.

* Full disk: a tmpfs of 512 KiB, filled by a file (topped up while the phase lasts, since every
  failure frees the state's own space), then freed. The exporter goes on producing without state,
  then writes a fresh snapshot, and a SIGKILL after that loses nothing.
* Read-only volume: an ext4 image mounted ``errors=remount-ro``, turned read-only by an ext4 error
  (``trigger_fs_error``): the kernel's own read-only, under the exporter's open files. A plain
  ``mount -o remount,ro`` is refused (EBUSY) while a process holds files open for writing, and this
  read-only cannot be remounted read-write in place; "writable again" is a tmpfs holding the files
  as the exporter left them (copied through the read-only mount), bind-mounted over it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.lab import Lab, LongConnection
from flow_exporter.flow import ADOPTED
from tests.support import contract
from tests.support.exporter_process import free_port, scrape, start_exporter, stop_exporter
from tests.support.records import read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka]


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(pods=3) as lab:
        yield lab


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def unmount(path: Path) -> None:
    """Unmount everything stacked on ``path`` (teardown: the exporter is gone by then)."""
    while subprocess.run(["mountpoint", "-q", str(path)]).returncode == 0:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, int], Path]]:
    """Mounts small tmpfs file systems; all unmounted at teardown."""
    made: list[Path] = []

    def make(name: str, size: int) -> Path:
        path = tmp_path / name
        path.mkdir()
        mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
        made.append(path)
        return path

    try:
        yield make
    finally:
        for path in reversed(made):
            unmount(path)


def fill(directory: Path, leave: int = 0) -> None:
    """Write to ``directory/filler`` until the file system is full, then give ``leave`` bytes back."""
    with contextlib.suppress(OSError), (directory / "filler").open("ab", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)
    if leave:
        filler = directory / "filler"
        os.truncate(filler, filler.stat().st_size - leave)


class Traffic:
    """Bytes on long connections from a thread, until stopped."""

    def __init__(self, conns: list[LongConnection], size: int = 700, every: float = 0.25) -> None:
        self.conns = conns
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(size, every), daemon=True)
        self._thread.start()

    def _run(self, size: int, every: float) -> None:
        while not self._stop.wait(every):
            for c in self.conns:
                c.send(size)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


class Truth:
    """The last counters ``conntrack -L`` showed for each client address and port."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.counts: dict[tuple[str, int], contract.Counts] = {}

    def sample(self, *conns: Any) -> None:
        table = self.lab.conntrack_entries()
        for c in conns:
            e = table.for_exchange(c)
            if e is not None:
                self.counts[(c.client_ip, c.client_port)] = (
                    e.orig_packets,
                    e.orig_bytes,
                    e.reply_packets,
                    e.reply_bytes,
                )


def metric(port: int, name: str) -> float:
    code, text = scrape(port, "/metrics")
    assert code == 200
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def check_exact(bootstrap: str, topic: str, truth: Truth, expected: int) -> list[dict[str, Any]]:
    """The contract on the topic, one connectionId per connection, and conntrack's totals by the consumer rule."""
    records = read_records(bootstrap, topic, expect_at_least=10)
    groups = contract.check(records)  # asserts one content per (connectionId, sequence)
    assert len(truth.counts) == expected
    for (ip, port), counts in truth.counts.items():
        mine = [rs for rs in groups.values() if rs[0]["sourceAddress"] == ip and rs[0]["sourcePort"] == port]
        assert len(mine) == 1, f"{ip}:{port}: {len(mine)} connectionIds"
        assert contract.consumer_sum(mine[0]) == counts, (ip, port)
    assert not any(r["flags"] & ADOPTED for r in records)  # no restart fell back to a new lineage
    return records


def test_full_disk_then_room_again_then_sigkill_loses_nothing(
    lab: Lab, kafka_broker: Any, kafka_topic: str, tmp_path: Path, tmpfs: Callable[[str, int], Path]
) -> None:
    p1, p2, p3 = lab.pods
    vol = tmpfs("vol", 512 << 10)
    state = ["--set", f"state.dir={vol / 'state'}"]
    port = free_port()
    log1, log2 = tmp_path / "run1.log", tmp_path / "run2.log"
    proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log1, *state, metrics_port=port)
    truth = Truth(lab)
    longs = [lab.open_tcp(p1, p3, 7500), lab.open_tcp(p2, p3, 7501), lab.open_tcp(p3, p1, 7502, family=6)]
    traffic = Traffic(longs)
    shorts = []
    stop_filling = threading.Event()
    try:
        shorts.append(lab.tcp_exchange(p1, p2, 9500, 1200, 3400))
        truth.sample(*shorts)
        time.sleep(3)  # records flowing, the journal growing
        fill(vol, leave=8192)  # the journal's next appends fill these 8 KiB, the last one part-way (a short write)
        wait_for("a failed write", lambda: metric(port, "flow_exporter_checkpoint_errors_total") > 0)

        def keep_full() -> None:  # a failure deletes the state and so frees its space: take that too
            while not stop_filling.wait(0.05):
                fill(vol)

        filler = threading.Thread(target=keep_full, daemon=True)
        filler.start()
        produced = metric(port, "flow_exporter_records_produced_total")
        shorts.append(lab.tcp_exchange(p2, p1, 9501, 500, 800))  # starts and ends with no state kept
        shorts.append(lab.udp_exchange(p3, p2, 5500, 90, 300, count=2))
        truth.sample(*shorts)
        time.sleep(6)
        assert metric(port, "flow_exporter_checkpoint_stale") == 0
        assert scrape(port, "/readyz")[0] == 200  # a full disk holds nothing back
        assert metric(port, "flow_exporter_records_produced_total") > produced
        stop_filling.set()
        filler.join(5)
        (vol / "filler").unlink()
        wait_for("a fresh snapshot", lambda: metric(port, "flow_exporter_checkpoint_broken") == 0)
        shorts.append(lab.tcp_exchange(p1, p3, 9502, 2000, 100, family=6))
        time.sleep(3)  # journaled after the fresh snapshot
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log2, *state)
        shorts.append(lab.tcp_exchange(p2, p3, 9503, 700, 700))
        time.sleep(3)
        traffic.stop()
        time.sleep(1.5)  # the last bytes polled
        truth.sample(*longs, *shorts)
        stop_exporter(proc, log2)
    finally:
        stop_filling.set()
        traffic.stop()
        if proc.poll() is None:
            proc.kill()
    run1, run2 = log1.read_text(), log2.read_text()
    assert "Traceback" not in run1 + run2
    assert "the state is deleted: records still go out" in run1
    assert "written again" in run1
    assert "continuing: checkpoint" in run2
    check_exact(kafka_broker.bootstrap, kafka_topic, truth, len(longs) + len(shorts))


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """An ext4 image mounted errors=remount-ro; the callable turns it read-only by an ext4 error."""
    image, path = tmp_path / "ext4.img", tmp_path / "ext4"
    path.mkdir()
    with image.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    mount("-o", "loop,errors=remount-ro", str(image), str(path))
    source = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(path)], check=True, capture_output=True, text=True)
    trigger = Path("/sys/fs/ext4") / Path(source.stdout.strip()).name / "trigger_fs_error"

    def read_only() -> None:
        trigger.write_text("1")
        with pytest.raises(OSError) as exc:
            (path / "probe").touch()
        assert exc.value.errno == errno.EROFS

    try:
        yield path, read_only
    finally:
        unmount(path)


@pytest.mark.parametrize("then", ["recovers in place", "restarts while stale"])
def test_read_only_volume_holds_records_back_and_its_state_continues_exactly(
    lab: Lab,
    kafka_broker: Any,
    kafka_topic: str,
    tmp_path: Path,
    tmpfs: Callable[[str, int], Path],
    ext4: tuple[Path, Callable[[], None]],
    then: str,
) -> None:
    p1, p2, p3 = lab.pods
    vol, read_only = ext4
    state = ["--set", f"state.dir={vol / 'state'}"]
    port = free_port()
    log1, log2 = tmp_path / "run1.log", tmp_path / "run2.log"
    proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log1, *state, metrics_port=port)
    truth = Truth(lab)
    longs = [lab.open_tcp(p1, p3, 7600), lab.open_tcp(p2, p3, 7601), lab.open_tcp(p3, p1, 7602, family=6)]
    traffic = Traffic(longs)
    shorts = []
    try:
        shorts.append(lab.tcp_exchange(p1, p2, 9600, 1200, 3400))
        truth.sample(*shorts)
        time.sleep(3)
        read_only()
        wait_for("a stale state", lambda: metric(port, "flow_exporter_checkpoint_stale") == 1)
        code, body = scrape(port, "/readyz")
        assert code == 503 and "held back" in body, body
        produced = metric(port, "flow_exporter_records_produced_total")
        if then == "recovers in place":  # ends while held back: its record goes out once a snapshot succeeds
            shorts.append(lab.tcp_exchange(p2, p1, 9601, 500, 800))
            truth.sample(*shorts)
        time.sleep(5)  # records due meanwhile: none may go out
        assert metric(port, "flow_exporter_records_produced_total") == produced
        assert metric(port, "flow_exporter_checkpoint_stale") == 1
        if then == "restarts while stale":
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        # Writable again, with the files as the exporter left them (read through the read-only mount).
        writable = tmpfs("writable", 16 << 20)
        shutil.copytree(vol / "state", writable / "state")
        mount("--bind", str(writable), str(vol))
        if then == "recovers in place":
            wait_for("a fresh snapshot", lambda: metric(port, "flow_exporter_checkpoint_broken") == 0)
            assert scrape(port, "/readyz")[0] == 200
            time.sleep(3)  # the records held back go out, then more, journaled
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log2, *state)
        shorts.append(lab.tcp_exchange(p1, p3, 9602, 2000, 100, family=6))
        time.sleep(3)
        traffic.stop()
        time.sleep(1.5)
        truth.sample(*longs, *shorts)
        stop_exporter(proc, log2)
    finally:
        traffic.stop()
        if proc.poll() is None:
            proc.kill()
    run1, run2 = log1.read_text(), log2.read_text()
    assert "Traceback" not in run1 + run2
    assert "the old checkpoint cannot be deleted (Read-only file system), so records are held back" in run1
    assert ("written again" in run1) == (then == "recovers in place")
    assert "continuing: checkpoint" in run2
    check_exact(kafka_broker.bootstrap, kafka_topic, truth, len(longs) + len(shorts))
