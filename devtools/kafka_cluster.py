"""A real three-broker Kafka cluster (KRaft, combined broker+controller voters) in network namespaces.

Production keeps a flow topic on a cluster (replication 3, ``min.insync.replicas`` 2) whose partition
leaders move during upgrades and failures. To test that, each broker runs in a network namespace of its
own, joined to the host's (root) namespace by a bridge, so a fault can cut one broker's links with
nftables (from the exporter only, or from its peers only) as well as stop, kill or pause its process.

Combined mode (every node a broker and a controller, a static quorum of three voters): the smallest
cluster where killing the active controller moves the quorum's leadership, as in a production
control plane of three, and one JVM per node on a 2-core machine.

The brokers are :class:`devtools.kafka.KafkaBroker` objects from the same Maven Central jars as the
single broker. Command line: ``python -m devtools.kafka_cluster serve`` runs one until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from devtools.kafka import KafkaBroker, KafkaBrokerError, cluster_id, ensure_jars, sigterm_as_interrupt
from devtools.lab.shell import run, run_in

__all__ = ["BROKERS", "SASL_USER", "KafkaCluster"]

BROKERS = 3
_QUIET = logging.getLogger(__name__ + ".rdkafka")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


class KafkaCluster:
    """Three KRaft brokers, one per network namespace on a bridge of the root namespace.

    Broker ``i`` (1..3) listens on ``10.251.N.1i:9092`` (``bootstrap`` names all three); the root
    namespace, where the exporter and the tests run, is ``10.251.N.1`` on the bridge. Faults:
    :meth:`terminate`, :meth:`kill`, :meth:`pause` / :meth:`resume` a broker's process, :meth:`start` it
    again, :meth:`cut` its links (``"clients"``: to and from the root namespace; ``"peers"``: to and
    from the other brokers) and :meth:`heal` them.
    """

    def __init__(self, workdir: Path | None = None, name: str | None = None) -> None:
        self.name = name or "kc" + secrets.token_hex(2)
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="kafka-cluster-")) if workdir is None else Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.net = 10 + secrets.randbelow(240)
        self.bridge = f"{self.name}br"
        self.host_ip = f"10.251.{self.net}.1"
        self.ips = {i: f"10.251.{self.net}.{10 + i}" for i in range(1, BROKERS + 1)}
        self.namespaces = {i: f"{self.name}-b{i}" for i in self.ips}
        voters = ",".join(f"{i}@{ip}:9093" for i, ip in self.ips.items())
        cid = cluster_id()
        self.brokers = {
            i: KafkaBroker(
                self.workdir / f"broker{i}", host=ip, netns=self.namespaces[i], node_id=i, voters=voters,
                cluster_id=cid, extra_props=_slow_listener(ip),
            )
            for i, ip in self.ips.items()
        }  # fmt: skip
        self.bootstrap = ",".join(b.bootstrap for b in self.brokers.values())
        # The same brokers through a relay in each namespace that delays what passes (delay()): a client that
        # bootstraps here talks to every broker through its relay (the SLOW listener advertises the relays).
        self.slow_bootstrap = ",".join(f"{ip}:{_SLOW_PORT}" for ip in self.ips.values())
        # The SASL listeners: a client there is User:flows (SASL_USER), the principal ACLs can refuse.
        self.sasl_bootstrap = ",".join(f"{ip}:{_SASL_PORT}" for ip in self.ips.values())
        self._relays: dict[int, subprocess.Popen[bytes]] = {}
        self._net_up = False
        self._closed = False
        self._refusing = False  # refuse_producer_ids' ACLs are (or may be) in place

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> KafkaCluster:
        try:
            self.start_all()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start_all(self, timeout: float = 120.0) -> None:
        """The network, then the three brokers at once (a voter answers once a quorum of them runs)."""
        ensure_jars()
        if not self._net_up:
            self._build_net()
        for i in self.brokers:
            if i not in self._relays:
                self._start_relay(i)
        for b in self.brokers.values():
            if not b.running:
                b.start(timeout, wait=False)
        for b in self.brokers.values():
            b.wait_ready(timeout)

    def _start_relay(self, i: int) -> None:
        self.delay(0)
        cmd = [
            "ip", "netns", "exec", self.namespaces[i], sys.executable, "-I", "-S", _RELAY, self.ips[i],
            str(_SLOW_PORT), "127.0.0.1", str(_SLOW_INNER_PORT), str(self._delay_file(i)),
        ]  # fmt: skip
        log = (self.workdir / f"relay{i}.log").open("ab")
        self._relays[i] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()

    def _delay_file(self, i: int) -> Path:
        return self.workdir / f"delay{i}.ms"

    def delay(self, ms: int, brokers: list[int] | None = None) -> None:
        """Delay what passes between the SLOW listener's clients (``slow_bootstrap``) and these brokers (all by
        default) by ``ms`` milliseconds each way; 0 ends it. The brokers' own links are not delayed."""
        for i in brokers or list(self.brokers):
            self._delay_file(i).write_text(str(ms))

    def close(self) -> None:
        """Stop every broker, remove the namespaces and the bridge, and the work dir if this object made it."""
        if self._closed:
            return
        self._closed = True
        for b in self.brokers.values():
            with contextlib.suppress(Exception):
                # Killed, not stopped: the last voters of a quorum going down cannot finish a controlled
                # shutdown (each waited 30 s for one); nothing of a test cluster needs its data flushed.
                b.kill()
                b.close()
        for relay in self._relays.values():
            relay.kill()
            relay.wait()
        self._relays.clear()
        self._delete_net()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _build_net(self) -> None:
        self._net_up = True
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for i, ns in self.namespaces.items():
            run("ip", "netns", "add", ns)
            host_end = f"{self.name}v{i}"
            run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "link", "set", host_end, "master", self.bridge)
            run("ip", "link", "set", host_end, "up")
            run(
                "ip", "-n", ns, "-b", "-",
                input=f"link set lo up\naddr add {self.ips[i]}/24 dev eth0\nlink set eth0 up\n",
            )  # fmt: skip
            # The fault table: empty until cut() fills it.
            run_in(ns, "nft", "-f", "-", input=_FAULT_TABLE)

    def _delete_net(self) -> None:
        if not self._net_up:
            return
        for ns in self.namespaces.values():
            run("ip", "netns", "del", ns, check=False)
        run("ip", "link", "del", self.bridge, check=False)
        self._net_up = False

    def restore(self, timeout: float = 120.0) -> None:
        """Undo every fault: links healed, paused brokers resumed, stopped ones started, ACLs gone (a test's
        teardown)."""
        for i, b in self.brokers.items():
            self.heal(i)
            if b.running:
                b.signal(signal.SIGCONT)
        for b in self.brokers.values():
            if not b.running:
                b.start(timeout, wait=False)
        for b in self.brokers.values():
            b.wait_ready(timeout)
        self.allow_producer_ids()

    # ------------------------------------------------------------------ ACLs
    def _producer_id_acls(self, filters: bool = False) -> list[Any]:
        """ACLs that refuse :data:`SASL_USER` a producer id.

        An idempotent producer gets its id (InitProducerId) with IdempotentWrite on the cluster or Write on
        any topic (KIP-679), so both are denied (its produce requests fail too, with a retriable-looking
        TOPIC_AUTHORIZATION_FAILED).
        """
        from confluent_kafka.admin import (
            AclBinding,
            AclBindingFilter,
            AclOperation,
            AclPermissionType,
            ResourcePatternType,
        )
        from confluent_kafka.admin import ResourceType as R

        make = AclBindingFilter if filters else AclBinding

        def acl(kind: Any, name: str, op: Any, permission: Any) -> Any:
            return make(kind, name, ResourcePatternType.LITERAL, f"User:{SASL_USER[0]}", "*", op, permission)

        return [
            # Wildcard ACLs replace "no ACL found": describing the topics stays allowed, writing them does not.
            acl(R.TOPIC, "*", AclOperation.ALL, AclPermissionType.ALLOW),
            acl(R.BROKER, "kafka-cluster", AclOperation.IDEMPOTENT_WRITE, AclPermissionType.DENY),
            acl(R.TOPIC, "*", AclOperation.WRITE, AclPermissionType.DENY),
        ]

    def refuse_producer_ids(self) -> None:
        """From now on every new idempotent producer fails with CLUSTER_AUTHORIZATION_FAILED, which librdkafka
        raises as a fatal error ("Failed to acquire idempotence PID"): the real cause of one, on a real cluster."""
        self._refusing = True
        admin = self.admin()  # kept until the futures resolve: a dropped client cancels them
        for future in admin.create_acls(self._producer_id_acls()).values():
            future.result()

    def allow_producer_ids(self, timeout: float = 60.0) -> None:
        """Remove :meth:`refuse_producer_ids`' ACLs (what an operator who fixed them would do); nothing to do when
        they were never set. Retried while a broker's connection is still settling after a fault."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + timeout
        while self._refusing:
            admin = self.admin()
            try:
                for future in admin.delete_acls(self._producer_id_acls(filters=True)).values():
                    future.result()
                self._refusing = False
            except KafkaException:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    # ------------------------------------------------------------------ what the cluster says
    def admin(self, **overrides: Any) -> Any:
        """A confluent-kafka AdminClient on all three brokers."""
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap, "logger": _QUIET, **overrides})

    def create_topic(
        self, name: str, partitions: int = 3, min_isr: int = 2, leader: int | None = None, timeout: float = 60.0
    ) -> None:
        """A topic as we recommend it on a cluster (replication 3, ``min.insync.replicas`` 2), waited for until
        every replica is in sync. ``leader``: the broker every partition prefers as its leader (a fault test's
        target), else Kafka spreads them."""
        from confluent_kafka.admin import NewTopic

        admin = self.admin()
        config = {"min.insync.replicas": str(min_isr)}
        if leader is None:
            topic = NewTopic(name, partitions, BROKERS, config=config)
        else:
            others = [i for i in self.brokers if i != leader]
            assignment = [[leader, *(others if p % 2 else others[::-1])] for p in range(partitions)]
            topic = NewTopic(name, partitions, replica_assignment=assignment, config=config)
        admin.create_topics([topic], request_timeout=timeout)[name].result(timeout=timeout)
        self.wait_in_sync(name, timeout)

    def partitions(self, topic: str) -> dict[int, Any]:
        """The topic's partitions as the cluster's metadata tells (leader, replicas, isrs)."""
        meta = self.admin().list_topics(topic=topic, timeout=10)
        t = meta.topics.get(topic)
        if t is None or t.error is not None:
            raise KafkaBrokerError(f"topic {topic!r}: {None if t is None else t.error}")
        return dict(t.partitions)

    def leader(self, topic: str, partition: int = 0) -> int:
        """The broker id leading ``partition`` of ``topic``."""
        return int(self.partitions(topic)[partition].leader)

    def wait_in_sync(self, topic: str, timeout: float = 60.0) -> None:
        """Until every partition has a leader and every replica in its ISR."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                parts = self.partitions(topic)
                if parts and all(p.leader >= 0 and sorted(p.isrs) == sorted(p.replicas) for p in parts.values()):
                    return
            except Exception:  # metadata may fail while the cluster settles
                pass
            if time.monotonic() >= deadline:
                raise KafkaBrokerError(f"topic {topic!r} not fully in sync after {timeout:.0f}s")
            time.sleep(0.2)

    def wait_agreed(self, topic: str, timeout: float = 60.0) -> None:
        """Until every running broker's own metadata gives each partition the same leader (a running broker) and
        the same ISR (of running brokers).

        :meth:`wait_in_sync` asks whichever broker answers; right after a fault a broker that was cut off can
        still believe it leads a partition, with the high watermark of before, and a reader that asks it for
        the partition's end stops short (seen: 5 of 126 acknowledged records read after the cut from peers).
        Each broker is asked here through a client that knows only it, so the first answer is that broker's.
        """
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        while True:
            views = []
            running = {i for i, b in self.brokers.items() if b.running}
            try:
                for b in (self.brokers[i] for i in sorted(running)):
                    admin = AdminClient({"bootstrap.servers": b.bootstrap, "logger": _QUIET})
                    meta = admin.list_topics(topic=topic, timeout=5).topics[topic]
                    if meta.error is not None:
                        raise KafkaBrokerError(str(meta.error))
                    views.append(
                        {p: (m.leader, sorted(m.isrs), sorted(m.replicas)) for p, m in meta.partitions.items()}
                    )
            except Exception:  # a broker that is still settling
                views = []
            if (
                views
                and all(v == views[0] for v in views)
                and all(leader in running and set(isrs) <= running for leader, isrs, _ in views[0].values())
            ):
                return
            if time.monotonic() >= deadline:
                raise KafkaBrokerError(
                    f"the brokers' metadata of {topic!r} did not agree within {timeout:.0f}s: {views}"
                )
            time.sleep(0.2)

    def active_controller(self) -> int:
        """The quorum's leader (the active controller), as kafka-metadata-quorum describes it."""
        out = self.tool("org.apache.kafka.tools.MetadataQuorumCommand", "describe", "--status")
        for line in out.splitlines():
            if line.startswith("LeaderId:"):
                return int(line.split(":", 1)[1])
        raise KafkaBrokerError(f"no LeaderId in the quorum's status:\n{out}")

    def tool(self, main: str, *args: str, timeout: float = 120.0) -> str:
        """A Kafka command-line tool from the same jars, against the cluster; its standard output."""
        java = shutil.which("java")
        if java is None:
            raise KafkaBrokerError("java is not on PATH")
        lib = ensure_jars()
        cmd = [java, "-Xmx256m", "-XX:TieredStopAtLevel=1", "-cp", f"{lib}/*", main]
        cmd += ["--bootstrap-server", self.bootstrap, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise KafkaBrokerError(f"{main} {' '.join(args)} (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return proc.stdout

    # ------------------------------------------------------------------ faults
    def terminate(self, i: int, timeout: float = 60.0) -> None:
        """SIGTERM broker ``i`` and wait for it to stop (a controlled shutdown moves its leaderships first)."""
        self.brokers[i].stop(timeout)

    def kill(self, i: int) -> None:
        """SIGKILL broker ``i`` (a crash: what reached its disk stays)."""
        self.brokers[i].kill()

    def pause(self, i: int) -> None:
        """SIGSTOP broker ``i``: it holds its sockets and answers nothing until :meth:`resume`."""
        self.brokers[i].signal(signal.SIGSTOP)

    def resume(self, i: int) -> None:
        self.brokers[i].signal(signal.SIGCONT)

    def start(self, i: int, timeout: float = 120.0) -> None:
        """Start broker ``i`` again on its data and wait until it answers."""
        self.brokers[i].start(timeout)

    def cut(self, i: int, side: str) -> None:
        """Drop every packet between broker ``i`` and ``side``: "clients" (the root namespace: the exporter,
        the tests) or "peers" (the other brokers: replication and the quorum)."""
        if side == "clients":
            addrs = [self.host_ip]
        elif side == "peers":
            addrs = [ip for j, ip in self.ips.items() if j != i]
        else:
            raise ValueError(f"cut {side!r}: 'clients' or 'peers'")
        rules = "".join(
            f"add rule inet fault in ip saddr {a} drop\nadd rule inet fault out ip daddr {a} drop\n" for a in addrs
        )
        run_in(self.namespaces[i], "nft", "-f", "-", input=rules)

    def heal(self, i: int) -> None:
        """Remove every cut of broker ``i``."""
        flush = "flush chain inet fault in\nflush chain inet fault out\n"
        run_in(self.namespaces[i], "nft", "-f", "-", input=flush)

    def __repr__(self) -> str:
        up = [i for i, b in self.brokers.items() if b.running]
        return f"<KafkaCluster {self.bootstrap} running {up}>"


_RELAY = str(Path(__file__).resolve().with_name("delay_relay.py"))
_SASL_PORT = 9094  # SASL_PLAINTEXT (PLAIN), for a client with a principal of its own
SASL_USER = ("flows", "flows-cluster-secret")  # that client's user and password
_SLOW_PORT = 9095  # where the relay listens, on the broker's address; advertised as the SLOW listener
_SLOW_INNER_PORT = 9196  # where the broker's SLOW listener binds, on the namespace's loopback


def _slow_listener(ip: str) -> dict[str, str]:
    """The listeners of a cluster's broker: PLAINTEXT (clients, replication) and CONTROLLER on its address, SASL
    (SASL_PLAINTEXT, user :data:`SASL_USER`) on its address, and SLOW bound to loopback behind the delaying relay,
    which its advertised address names. ACLs are on: a resource no ACL speaks of is open to all, and
    User:ANONYMOUS (every PLAINTEXT client, the brokers and controllers among them) is a super user, so only
    :meth:`KafkaCluster.refuse_producer_ids` refuses anything, and only to :data:`SASL_USER`."""
    return {
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "true",
        "super.users": "User:ANONYMOUS",
        "listeners": (
            f"PLAINTEXT://{ip}:9092,CONTROLLER://{ip}:9093,SASL://{ip}:{_SASL_PORT},SLOW://127.0.0.1:{_SLOW_INNER_PORT}"
        ),
        "advertised.listeners": f"PLAINTEXT://{ip}:9092,SASL://{ip}:{_SASL_PORT},SLOW://{ip}:{_SLOW_PORT}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL:SASL_PLAINTEXT,SLOW:PLAINTEXT",
        "listener.name.sasl.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.sasl.plain.sasl.jaas.config": (
            f'org.apache.kafka.common.security.plain.PlainLoginModule required user_{SASL_USER[0]}="{SASL_USER[1]}";'
        ),
    }


_FAULT_TABLE = """
table inet fault {
    chain in { type filter hook input priority filter; policy accept; }
    chain out { type filter hook output priority filter; policy accept; }
}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.kafka_cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run a three-broker cluster until Ctrl-C (needs root: namespaces)")
    serve.add_argument("--topic", action="append", default=[], help="create this topic (3 partitions, RF 3)")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        with sigterm_as_interrupt(), KafkaCluster() as cluster:
            for t in args.topic:
                cluster.create_topic(t)
            print(f"bootstrap.servers={cluster.bootstrap}", flush=True)
            for i, b in cluster.brokers.items():
                print(f"broker {i}: {b.bootstrap}, pid {b.pid}, netns {b.netns}, log {b.log_path}", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
