"""A real kube-apiserver (backed by a real etcd) on loopback, for tests.

The exporter's Kubernetes side (pod/service lookups, watches, RBAC of its ServiceAccount, the
manifests it ships) is tested against the real API server rather than a mock, so validation,
RBAC denials, watch semantics and server restarts behave as in a cluster. Only etcd and
kube-apiserver run: no controller-manager, scheduler or kubelet, so tests write pod status
themselves and nothing garbage-collects. Both binaries are built from the Go module proxy by
``tools/k8s/build.sh`` (Kubernetes publishes no installable kube-apiserver) into
``.cache/k8s/<version>/bin``.

Certificates, the ServiceAccount signing key and an admin bearer token (group system:masters) are
made with the ``openssl`` CLI in the server's work directory, next to ``etcd.log`` and
``apiserver.log``.

Command line: ``python -m devtools.apiserver build`` (build or find the binaries) and
``python -m devtools.apiserver serve`` (run a server until Ctrl-C, print its kubeconfig).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml

from devtools.net import free_ports

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from kubernetes.dynamic import DynamicClient

__all__ = [
    "AlreadyExists",
    "ApiServer",
    "ApiServerError",
    "binaries_dir",
    "ensure_binaries",
    "k8s_version",
]

# This module lives at <root>/devtools/apiserver.py.
_REPO_ROOT = Path(__file__).resolve().parents[1]
_TOOLS = _REPO_ROOT / "tools" / "k8s"
_BUILD_SCRIPT = _TOOLS / "build.sh"
# A cold build takes about ten minutes on two cores; past this something hangs.
_BUILD_TIMEOUT = 3600.0
_FIELD_MANAGER = "flow-exporter-tests"
_SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
_CLUSTER = "flow-exporter-test"
_TAIL_LINES = 40

# The state a cluster without controllers cannot provide: the ServiceAccount admission plugin
# rejects every pod until the token controller has created the namespace's "default" account.
DEFAULT_DISABLED_ADMISSION: tuple[str, ...] = ("ServiceAccount",)
# Dual-stack, so pods and services can carry IPv6 addresses as the exporter sees them.
DEFAULT_SERVICE_CIDRS: tuple[str, ...] = ("10.96.0.0/16", "fd10:96::/112")


class ApiServerError(RuntimeError):
    """The binaries could not be built, or etcd / kube-apiserver did not come up."""


class AlreadyExists(ApiServerError):
    """A create answered 409 Conflict: the object is there already."""


class _PortInUse(ApiServerError):
    """A port picked as free was taken before the server bound it; the caller picks again."""


def k8s_version() -> str:
    """The Kubernetes release that ``tools/k8s/apiserver/go.mod`` pins, e.g. ``1.35.4``."""
    text = (_TOOLS / "apiserver" / "go.mod").read_text()
    match = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+v(\S+)", text, re.MULTILINE)
    if not match:
        raise ApiServerError("tools/k8s/apiserver/go.mod does not require k8s.io/kubernetes")
    return match.group(1)


def binaries_dir() -> Path:
    """Where build.sh puts ``kube-apiserver`` and ``etcd`` for the pinned version."""
    return _REPO_ROOT / ".cache" / "k8s" / k8s_version() / "bin"


def ensure_binaries() -> Path:
    """Build kube-apiserver and etcd if needed and return their directory.

    The build script is always run (it returns in milliseconds when its marker matches), so a
    bumped go.mod rebuilds. Without a Go toolchain, already-built binaries are used as they are.
    """
    bin_dir = binaries_dir()
    have = all((bin_dir / name).is_file() for name in ("kube-apiserver", "etcd"))
    if have and shutil.which("go") is None:
        return bin_dir
    try:
        proc = subprocess.run(
            ["bash", str(_BUILD_SCRIPT)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ApiServerError(f"{_BUILD_SCRIPT.name} took over {_BUILD_TIMEOUT:.0f}s") from exc
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        raise ApiServerError(lines[-1] if lines else f"{_BUILD_SCRIPT} exited with {proc.returncode}")
    return bin_dir


class ApiServer:
    """etcd plus kube-apiserver on free loopback ports, with an admin kubeconfig.

    Use as a context manager, or call ``start()`` / ``stop()`` directly: ``stop()`` keeps the
    etcd data, ports and credentials, so a later ``start()`` brings back the same cluster (for
    "API server went away mid-watch" tests). ``close()`` also removes a work dir it created.
    Children run in their own process groups, die with this process (PR_SET_PDEATHSIG via
    ``setpriv``, when started from the main thread) and are stopped by an atexit hook as well.
    """

    def __init__(
        self,
        workdir: Path | str | None = None,
        *,
        service_cidrs: Sequence[str] = DEFAULT_SERVICE_CIDRS,
        disable_admission_plugins: Sequence[str] = DEFAULT_DISABLED_ADMISSION,
        extra_args: Sequence[str] = (),
        start_timeout: float = 90.0,
    ) -> None:
        self._owns_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="kube-apiserver-") if workdir is None else workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.service_cidrs = tuple(service_cidrs)
        self.disable_admission_plugins = tuple(disable_admission_plugins)
        self.extra_args = tuple(extra_args)
        self.start_timeout = start_timeout
        self.service_account_issuer = _SA_ISSUER

        self.pki_dir = self.workdir / "pki"
        self.ca_path = self.pki_dir / "ca.crt"
        self.etcd_log = self.workdir / "etcd.log"
        self.apiserver_log = self.workdir / "apiserver.log"
        self.admin_kubeconfig = self.workdir / "admin.kubeconfig"
        self._token_file = self.workdir / "tokens.csv"
        self._etcd_data = self.workdir / "etcd-data"
        self.admin_token = ""
        self.port = 0
        self._etcd_client_port = 0
        self._etcd_peer_port = 0
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self._bin_dir: Path | None = None
        self._dynamic: DynamicClient | None = None
        self._atexit_registered = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def url(self) -> str:
        """The secure endpoint, ``https://127.0.0.1:<port>`` (fixed once first started)."""
        if not self.port:
            raise ApiServerError("the API server has not been started yet")
        return f"https://127.0.0.1:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self._etcd_client_port}"

    @property
    def running(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self._etcd, self._apiserver))

    def start(self) -> ApiServer:
        """Start etcd and kube-apiserver (a no-op when both run) and wait for ``/readyz``.

        The first start generates credentials and picks ports; later ones reuse them and the etcd
        data. A port taken between picking and binding is picked again, on the first start only.
        """
        with self._lock:
            if self.running:
                return self
            self._stop_children()
            if self._bin_dir is None:
                self._bin_dir = ensure_binaries()
            first = not self.port
            if first:
                self._make_credentials()
            for attempt in range(3):
                if first:
                    self.port, self._etcd_client_port, self._etcd_peer_port = free_ports(3)
                try:
                    self._start_etcd()
                    self._start_apiserver()
                    break
                except _PortInUse:
                    self._stop_children()
                    if not first or attempt == 2:
                        raise
                except BaseException:
                    self._stop_children()
                    raise
            if first:
                self._write_kubeconfig(self.admin_kubeconfig, "admin", self.admin_token)
            if not self._atexit_registered:
                atexit.register(self._atexit_stop)
                self._atexit_registered = True
            return self

    def stop(self, timeout: float = 20.0) -> None:
        """Stop kube-apiserver, then etcd, keeping all state on disk for ``start()``."""
        with self._lock:
            self._stop_children(timeout)

    def close(self) -> None:
        """Stop both servers and delete the work dir if this object created it."""
        self.stop()
        if self._dynamic is not None:
            self._dynamic.client.close()
            self._dynamic = None
        if self._atexit_registered:
            atexit.unregister(self._atexit_stop)
            self._atexit_registered = False
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _atexit_stop(self) -> None:
        with contextlib.suppress(Exception):
            self._stop_children(10.0)

    def _stop_children(self, timeout: float = 20.0) -> None:
        # The API server first, so it does not log a burst of etcd connection errors.
        for attr in ("_apiserver", "_etcd"):
            proc = getattr(self, attr)
            if proc is not None:
                _terminate(proc, timeout)
                setattr(self, attr, None)

    # ------------------------------------------------------------------ processes

    def _start_etcd(self) -> None:
        assert self._bin_dir is not None
        client = self.etcd_url
        peer = f"http://127.0.0.1:{self._etcd_peer_port}"
        cmd = [
            str(self._bin_dir / "etcd"),
            "--name=default",
            f"--data-dir={self._etcd_data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--initial-cluster-state=new",
            # Test data need not survive a machine crash; fsync dominates etcd's write latency.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]
        self._etcd = _spawn(cmd, self.etcd_log, self.workdir)
        deadline = time.monotonic() + self.start_timeout
        while True:
            self._check_alive(self._etcd, "etcd", self.etcd_log)
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(f"{client}/health", timeout=2) as resp,
            ):
                if json.load(resp).get("health") == "true":
                    return
            if time.monotonic() > deadline:
                raise ApiServerError(f"etcd not healthy after {self.start_timeout:.0f}s{_excerpt(self.etcd_log)}")
            time.sleep(0.05)

    def _start_apiserver(self) -> None:
        assert self._bin_dir is not None
        pki = self.pki_dir
        cmd = [
            str(self._bin_dir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            "--advertise-address=127.0.0.1",
            # No controller would keep the kubernetes Endpoints right, and loopback is not a
            # valid endpoint address anyway.
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={pki / 'server.crt'}",
            f"--tls-private-key-file={pki / 'server.key'}",
            f"--client-ca-file={self.ca_path}",
            f"--token-auth-file={self._token_file}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={self.service_account_issuer}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={','.join(self.service_cidrs)}",
            # The exporter's DaemonSet is privileged; its dry-run must not be refused for that.
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]
        if self.disable_admission_plugins:
            cmd.append(f"--disable-admission-plugins={','.join(self.disable_admission_plugins)}")
        cmd.extend(self.extra_args)
        self._apiserver = _spawn(cmd, self.apiserver_log, self.workdir)
        self._wait_ready()

    def _wait_ready(self) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        request = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"})
        deadline = time.monotonic() + self.start_timeout
        last = "no answer"
        while True:
            assert self._etcd is not None and self._apiserver is not None
            self._check_alive(self._etcd, "etcd", self.etcd_log)
            self._check_alive(self._apiserver, "kube-apiserver", self.apiserver_log)
            try:
                with urllib.request.urlopen(request, timeout=5, context=ctx) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (OSError, ssl.SSLError) as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise ApiServerError(
                    f"kube-apiserver not ready after {self.start_timeout:.0f}s (last /readyz: {last})"
                    f"{_excerpt(self.apiserver_log)}"
                )
            time.sleep(0.1)

    @staticmethod
    def _check_alive(proc: subprocess.Popen[bytes], name: str, log: Path) -> None:
        rc = proc.poll()
        if rc is None:
            return
        tail = _tail(log)
        if "address already in use" in tail:
            raise _PortInUse(f"{name}: a port was taken")
        raise ApiServerError(f"{name} exited with code {rc} during start-up{_excerpt(log)}")

    # ------------------------------------------------------------------ credentials

    def _make_credentials(self) -> None:
        """A CA, a serving cert for the loopback names, the SA signing key and the admin token."""
        pki = self.pki_dir
        pki.mkdir(parents=True, exist_ok=True)
        # Our own config, so the system openssl.cnf cannot add or duplicate extensions. Key
        # identifiers and a critical CA flag keep strict verifiers (Python 3.13's default) happy.
        (pki / "openssl.cnf").write_text(
            "[req]\n"
            "distinguished_name = dn\n"
            "prompt = no\n"
            "[dn]\n"
            "CN = unused\n"
            "[ca_ext]\n"
            "basicConstraints = critical, CA:TRUE\n"
            "keyUsage = critical, keyCertSign, cRLSign, digitalSignature\n"
            "subjectKeyIdentifier = hash\n"
            "authorityKeyIdentifier = keyid:always\n"
            "[server_ext]\n"
            "basicConstraints = critical, CA:FALSE\n"
            "keyUsage = critical, digitalSignature\n"
            "extendedKeyUsage = serverAuth\n"
            "subjectKeyIdentifier = hash\n"
            "authorityKeyIdentifier = keyid:always\n"
            "subjectAltName = IP:127.0.0.1, IP:::1, DNS:localhost, DNS:kubernetes, DNS:kubernetes.default,"
            " DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local\n"
        )
        names = ("openssl.cnf", "ca.crt", "ca.key", "server.key", "server.csr", "server.crt", "sa.key", "sa.pub")
        files = {name: pki / name for name in names}
        ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
        _openssl(
            f"req -x509 -config {{openssl.cnf}} -extensions ca_ext {ec} -sha256 -days 3650 -subj {{subj}}"
            " -keyout {ca.key} -out {ca.crt}",
            subj="/CN=flow-exporter test CA",
            **files,
        )
        _openssl(
            f"req -new -config {{openssl.cnf}} {ec} -subj /CN=kube-apiserver"
            " -keyout {server.key} -out {server.csr}",
            **files,
        )
        _openssl(
            "x509 -req -in {server.csr} -CA {ca.crt} -CAkey {ca.key} -set_serial {serial} -days 3650 -sha256"
            " -extfile {openssl.cnf} -extensions server_ext -out {server.crt}",
            serial=str(secrets.randbits(63)),
            **files,
        )
        _openssl("genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out {sa.key}", **files)
        _openssl("pkey -in {sa.key} -pubout -out {sa.pub}", **files)
        self.admin_token = secrets.token_urlsafe(32)
        # token,user,uid,groups: system:masters passes every authorization check.
        self._token_file.write_text(f"{self.admin_token},admin,admin,system:masters\n")
        for path in (self._token_file, files["ca.key"], files["server.key"], files["sa.key"]):
            path.chmod(0o600)

    def _write_kubeconfig(self, path: Path, user: str, token: str, namespace: str | None = None) -> None:
        context: dict[str, str] = {"cluster": _CLUSTER, "user": user}
        if namespace:
            context["namespace"] = namespace
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": _CLUSTER,
                    "cluster": {
                        "server": self.url,
                        # Embedded, so the file still works when copied (e.g. into a lab namespace).
                        "certificate-authority-data": base64.b64encode(self.ca_path.read_bytes()).decode(),
                    },
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": context}],
            "current-context": user,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        tmp.chmod(0o600)
        tmp.replace(path)

    # ------------------------------------------------------------------ clients and helpers

    def api_client(self, kubeconfig: Path | None = None) -> ApiClient:
        """A kubernetes ``ApiClient`` for a kubeconfig (the admin one by default)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.admin_kubeconfig))

    def service_account_kubeconfig(self, namespace: str, name: str, *, expiration_seconds: int = 86400) -> Path:
        """A kubeconfig acting as ServiceAccount ``namespace/name``, so RBAC applies as in a pod.

        Creates the namespace and the ServiceAccount if missing, and mints a bound token through
        the TokenRequest API (no token controller runs, so no Secret-based token would appear).
        """
        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)
            with contextlib.suppress(AlreadyExists):
                _created(core.create_namespace, {"metadata": {"name": namespace}})
            with contextlib.suppress(AlreadyExists):
                _created(core.create_namespaced_service_account, namespace, {"metadata": {"name": name}})
            spec = client.V1TokenRequestSpec(
                audiences=[self.service_account_issuer], expiration_seconds=expiration_seconds
            )
            token = core.create_namespaced_service_account_token(
                name, namespace, client.AuthenticationV1TokenRequest(spec=spec)
            ).status.token
        safe = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{namespace}-{name}")
        path = self.workdir / "kubeconfigs" / f"sa-{safe}.kubeconfig"
        self._write_kubeconfig(path, f"system:serviceaccount:{namespace}:{name}", token, namespace)
        return path

    def dynamic_client(self) -> DynamicClient:
        """The admin dynamic client (discovery is cached across calls, refreshed on a miss)."""
        if self._dynamic is None:
            from kubernetes.dynamic import DynamicClient

            self._dynamic = DynamicClient(self.api_client())
        return self._dynamic

    def forget_discovery(self) -> None:
        """Drop the dynamic client's discovery cache (after a CRD was created, to see its kind)."""
        self._dynamic = None

    def apply(self, manifest_docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Create or update each object as admin, in order, and return what the server stored.

        Server-side apply with force: like ``kubectl apply --server-side --force-conflicts``, so
        applying the same docs again is a no-op and fields dropped from a doc are removed.
        """
        return [self._apply_one(doc, dry_run=False) for doc in manifest_docs if doc]

    def dry_run_apply(self, manifest_docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Validate docs with a server-side dry run (``dryRun=All``, strict field validation).

        Nothing is stored except the namespaces the docs live in (created for real when missing),
        since admission refuses even a dry-run create in a namespace that does not exist. Raises
        the client's ``ApiException``: 422 for an invalid value, 404 for an unknown kind, and (an
        upstream quirk, kubernetes/kubernetes#122480) 500 "field not declared in schema" for an
        unknown field.
        """
        docs = [doc for doc in manifest_docs if doc]
        wanted = {doc["metadata"]["namespace"] for doc in docs if doc.get("metadata", {}).get("namespace")}
        declared = {
            doc["metadata"]["name"] for doc in docs if (doc.get("apiVersion"), doc.get("kind")) == ("v1", "Namespace")
        }
        namespaces = wanted - declared
        if namespaces:
            self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in sorted(namespaces))
        return [self._apply_one(doc, dry_run=True) for doc in docs]

    def _apply_one(self, doc: dict[str, Any], *, dry_run: bool) -> dict[str, Any]:
        dyn = self.dynamic_client()
        resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        meta = doc.get("metadata", {})
        result = dyn.server_side_apply(
            resource,
            body=doc,
            name=meta.get("name"),
            namespace=(meta.get("namespace") or "default") if resource.namespaced else None,
            field_manager=_FIELD_MANAGER,
            force_conflicts=True,
            dry_run="All" if dry_run else None,
            query_params=[("fieldValidation", "Strict")],
        )
        return result.to_dict()


# ---------------------------------------------------------------------------- helpers


def _created(create: Callable[..., Any], *args: Any) -> Any:
    """Call a client ``create_*`` method, turning 409 Conflict into :class:`AlreadyExists`."""
    from kubernetes.client.rest import ApiException

    try:
        return create(*args)
    except ApiException as exc:
        if exc.status == 409:
            raise AlreadyExists(str(exc.reason)) from exc
        raise


def _spawn(cmd: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session with output appended to ``log``.

    ``setpriv --pdeathsig`` (util-linux) makes the kernel kill the child if this process dies
    without running atexit; it fires when the starting *thread* exits, hence main thread only.
    """
    setpriv = shutil.which("setpriv")
    if setpriv and threading.current_thread() is threading.main_thread():
        cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
    with open(log, "ab") as out:
        out.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(cmd)}\n".encode())
        out.flush()
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the child's process group, SIGKILL it if it lingers past ``timeout``."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        except PermissionError:
            proc.send_signal(sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _openssl(template: str, **values: str | Path) -> None:
    """Run ``openssl`` with ``template`` split on spaces first, so paths and values may hold any."""
    args = [re.sub(r"\{([\w.]+)\}", lambda m: str(values[m.group(1)]), word) for word in template.split()]
    try:
        proc = subprocess.run(["openssl", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise ApiServerError("openssl is needed to make the test certificates (apt-get install openssl)") from exc
    if proc.returncode != 0:
        raise ApiServerError(f"openssl {args[0]} failed: {proc.stderr.strip()[-500:]}")


def _tail(path: Path, lines: int = _TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            data = fh.read()
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return "(no log)"
        raise
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _excerpt(path: Path) -> str:
    return f"\n--- last {_TAIL_LINES} lines of {path} ---\n{_tail(path)}"


# ---------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.apiserver", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build kube-apiserver and etcd if needed, print their directory")
    serve = sub.add_parser("serve", help="run an API server until Ctrl-C")
    serve.add_argument("--workdir", type=Path, help="keep state here (default: a temporary directory)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            start = time.monotonic()
            path = ensure_binaries()
            print(f"{path} ({time.monotonic() - start:.1f}s)")
            return 0
        start = time.monotonic()
        with ApiServer(args.workdir) as server:
            print(f"kube-apiserver {k8s_version()} ready at {server.url} in {time.monotonic() - start:.1f}s")
            print(f"export KUBECONFIG={server.admin_kubeconfig}", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
        return 0
    except ApiServerError as exc:
        print(f"apiserver: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
