"""Kubernetes objects as a user or a controller creates them, on the test API server (devtools.apiserver).

No controller or kubelet runs there, so a test creates what they would: a Deployment's
ReplicaSet, a Job's pods, each with the ownerReference its controller writes, and pods' and
nodes' status (addresses) through the status subresource. Used by the enrichment tests and the
downstream end-to-end test.
"""

from __future__ import annotations

import contextlib
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException


def ensure_node(
    core: client.CoreV1Api, name: str, address: str, pod_cidrs: list[str] | None = None, zone: str | None = None
) -> None:
    """A Node with ``address`` as its InternalIP and ``zone`` as its topology label (what enrichment reads).

    Idempotent: tests of one session share node names such as the exporter's own.
    """
    spec = {"podCIDR": pod_cidrs[0], "podCIDRs": pod_cidrs} if pod_cidrs else {}
    with contextlib.suppress(ApiException):  # 409: another test made it already
        core.create_node({"metadata": {"name": name}, "spec": spec})
    if zone is not None:
        core.patch_node(name, {"metadata": {"labels": {"topology.kubernetes.io/zone": zone}}})
    core.patch_node_status(name, {"status": {"addresses": [{"type": "InternalIP", "address": address}]}})


def make_pod(
    core: client.CoreV1Api,
    ns: str,
    name: str,
    node: str,
    ips: list[str],
    labels: dict[str, str] | None = None,
    host_network: bool = False,
    owner: dict[str, Any] | None = None,
) -> None:
    """A pod bound to ``node`` and, since no kubelet runs, given its addresses through the status subresource.

    ``owner``: the object whose controller made it (its ownerReference, as that controller writes it).
    """
    spec = {
        "nodeName": node,
        "hostNetwork": host_network,
        "containers": [{"name": "c", "image": "pause:3.10"}],
    }
    meta: dict[str, Any] = {"name": name, "labels": labels or {"app": name}}
    if owner is not None:
        meta["ownerReferences"] = [controlled_by(owner)]
    core.create_namespaced_pod(ns, {"metadata": meta, "spec": spec})
    status = {"phase": "Running", "podIP": ips[0], "podIPs": [{"ip": a} for a in ips]}
    core.patch_namespaced_pod_status(name, ns, {"status": status})


def controlled_by(obj: dict[str, Any]) -> dict[str, Any]:
    """The ownerReference a controller puts on what it creates."""
    meta = obj["metadata"]
    return {
        "apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"], "uid": meta["uid"],
        "controller": True, "blockOwnerDeletion": True,
    }  # fmt: skip


def create(api: Any, method: str, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    """Create an object through the typed client; its body as the server returned it (uid included)."""
    made = getattr(api, method)(ns, body)
    out: dict[str, Any] = api.api_client.sanitize_for_serialization(made)
    return out


def pod_template(app: str, restart: str = "Always") -> dict[str, Any]:
    """A pod template for a workload object (the API server requires one; no controller ever uses it)."""
    containers = [{"name": "c", "image": "pause:3.10"}]
    return {"metadata": {"labels": {"app": app}}, "spec": {"containers": containers, "restartPolicy": restart}}
