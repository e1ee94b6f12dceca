"""Quick dump + decode rate on a real conntrack table in a throw-away network namespace.

    sudo .venv/bin/python bench/bench_decode_quick.py [--entries 100000] [--runs 5] [--skip-pyroute2]

Loads the table with `conntrack -R`, then times (entries/s):
  * ConntrackDumper.dump()            - what the exporter does (kernel dump + recv + decode)
  * bare recv loop                    - kernel dump + recv only: the floor for any decoder
  * Decoder on captured buffers       - decode alone
  * pyroute2 NFCTSocket.dump()        - consumed fully, one get_attr per entry
  * ip netns exec NS conntrack -L > /dev/null
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flow_exporter.connection import Connection
from flow_exporter.conntrack import ConntrackDumper, Decoder, enable_accounting, run_in_netns

NETLINK_NETFILTER = 12
DUMP_REQUEST = struct.pack("=IHHIIBBH", 20, (1 << 8) | 1, 0x301, 1, 0, socket.AF_UNSPEC, 0, 0)


def table_lines(n: int, seed: int = 1) -> list[str]:
    """A table shaped like a busy node: mostly TCP/UDP IPv4, some IPv6 and ICMP, a few zones."""
    rnd = random.Random(seed)
    lines = []
    for i in range(n):
        zone = " --zone 5" if i % 50 == 0 else ""
        sport = 1024 + i % 60000
        r = i % 20
        if r < 16:
            s = f"10.{rnd.randrange(256)}.{rnd.randrange(256)}.{rnd.randrange(1, 255)}"
            d = f"172.16.{rnd.randrange(256)}.{rnd.randrange(1, 255)}"
        else:
            s = f"2001:db8:{rnd.randrange(65536):x}::{rnd.randrange(1, 65536):x}"
            d = f"2001:db8:ffff::{rnd.randrange(1, 65536):x}"
        kind = r % 10
        if kind < 6:
            lines.append(f"-I -p tcp -s {s} -d {d} --sport {sport} --dport {rnd.choice([80, 443, 5432])} "
                         f"--state ESTABLISHED -u ASSURED,SEEN_REPLY -t 3600{zone}")
        elif kind < 9:
            lines.append(f"-I -p udp -s {s} -d {d} --sport {sport} --dport 53 -t 3600{zone}")
        elif ":" in s:
            lines.append(f"-I -p icmpv6 -s {s} -d {d} --icmpv6-type 128 --icmpv6-code 0 --icmpv6-id {i % 65536} "
                         f"-t 3600{zone}")
        else:
            lines.append(f"-I -p icmp -s {s} -d {d} --icmp-type 8 --icmp-code 0 --icmp-id {i % 65536} -t 3600{zone}")
    return lines


def timed(fn: Callable[[], int], runs: int) -> list[tuple[float, int]]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        n = fn()
        out.append((time.perf_counter() - t, n))
    return out


def report(name: str, results: list[tuple[float, int]]) -> None:
    rates = sorted(n / dt for dt, n in results)
    times = sorted(dt for dt, _ in results)
    print(f"{name:<34} median {statistics.median(rates):>9,.0f}/s  best {rates[-1]:>9,.0f}/s  "
          f"worst {rates[0]:>9,.0f}/s  (median {statistics.median(times):.3f} s for {results[0][1]:,}, "
          f"{len(results)} runs)", flush=True)


def netns_socket(ns: str) -> socket.socket:
    sock = run_in_netns(ns, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER))
    sock.bind((0, 0))
    return sock


def recv_dump(sock: socket.socket, keep: list[bytes] | None) -> int:
    """Reads one dump to NLMSG_DONE, walking only message headers; returns the message count."""
    buf = bytearray(1 << 20)
    hdr = struct.Struct("=IH").unpack_from
    sock.send(DUMP_REQUEST)
    count = 0
    while True:
        n = sock.recv_into(buf)
        if keep is not None:
            keep.append(bytes(buf[:n]))
        off = 0
        while off + 16 <= n:
            mlen, mtype = hdr(buf, off)
            if mtype in (2, 3):  # NLMSG_ERROR, NLMSG_DONE
                return count
            count += 1
            off += (mlen + 3) & ~3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--skip-pyroute2", action="store_true", help="skip the slow (~10 s per 100k) pyroute2 run")
    args = ap.parse_args(argv)

    ns = f"ctbench-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for warning in enable_accounting(ns):
            print("warning:", warning)
        path = Path(f"/tmp/{ns}.ct")
        path.write_text("\n".join(table_lines(args.entries)) + "\n")
        t = time.perf_counter()
        subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-R", str(path)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        path.unlink()
        print(f"netns {ns}: loaded {args.entries:,} entries in {time.perf_counter() - t:.2f} s "
              f"(acct + timestamp on)", flush=True)

        with ConntrackDumper(netns=ns) as dumper:
            total = dumper.count()
            print(f"count() = {total:,}; python {sys.version.split()[0]}, kernel {os.uname().release}, "
                  f"load average {os.getloadavg()[0]:.2f} (other load skews every number below)")
            dumper.dump()  # warm-up
            cpu0 = os.times()
            res = timed(lambda: len(dumper.dump()), args.runs)
            cpu1 = os.times()
            report("ConntrackDumper.dump()", res)
            user, system = (cpu1.user - cpu0.user) / args.runs, (cpu1.system - cpu0.system) / args.runs
            print(f"{'':<34} cpu per dump: user {user:.3f} s + sys {system:.3f} s = "
                  f"{total / (user + system):,.0f} entries per cpu-second")
            five = timed(lambda: len(dumper.dump(zones={5})), args.runs)
            print(f"{'dump(zones={5})':<34} median {statistics.median(dt for dt, _ in five):.3f} s "
                  f"for {five[0][1]:,} of {total:,} entries")

        sock = netns_socket(ns)
        try:
            report("bare recv loop (no decode)", timed(lambda: recv_dump(sock, None), args.runs))
            captured: list[bytes] = []
            recv_dump(sock, captured)
        finally:
            sock.close()

        def decode_only() -> int:
            out: list[Connection] = []
            decoder = Decoder()
            gc.disable()  # as ConntrackDumper.dump does
            try:
                for b in captured:
                    decoder.decode_batch(b, out)
            finally:
                gc.enable()
            return len(out)

        report("Decoder on captured buffers", timed(decode_only, args.runs))

        def conntrack_l() -> int:
            subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-L"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return total

        report("conntrack -L > /dev/null", timed(conntrack_l, args.runs))

        if not args.skip_pyroute2:
            from pyroute2 import NFCTSocket

            def pyroute2_dump() -> int:
                ct = NFCTSocket(nfgen_family=socket.AF_UNSPEC, netns=ns)
                try:
                    return sum(1 for m in ct.dump() if m.get_attr("CTA_ID") is not None)
                finally:
                    ct.close()

            report("pyroute2 NFCTSocket.dump()", timed(pyroute2_dump, 1))
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
