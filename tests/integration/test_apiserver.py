"""The test API server behaves like a cluster's for what the exporter relies on.

Pods get IPs only through the status subresource (no kubelet runs), services get ClusterIPs from
both families, RBAC really denies a ServiceAccount what its role lacks, watches deliver events,
manifests can be validated by a server-side dry run, and a stop/start keeps the stored objects.
"""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from devtools.apiserver import ApiServer

POD_IPS = ["10.244.1.5", "fd00:10:244:1::5"]


@pytest.fixture
def core(apiserver: ApiServer) -> Iterator[client.CoreV1Api]:
    with apiserver.api_client() as api:
        yield client.CoreV1Api(api)


@pytest.fixture
def namespace(core: client.CoreV1Api) -> str:
    """A fresh namespace per test (never deleted: no namespace controller would finish it)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace({"metadata": {"name": name}})
    return name


def _pod(name: str) -> dict[str, Any]:
    # nodeName set: no scheduler runs, and the exporter matches pods to its node by it.
    return {
        "metadata": {"name": name, "labels": {"app": "web"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]},
    }


def as_json(obj: Any) -> dict[str, Any]:
    """An API object as the server sent it: field names as in the API, the same in every client version
    (the generated attribute names are not: ``pod_i_ps`` before kubernetes 36, ``pod_ips`` since)."""
    return client.ApiClient().sanitize_for_serialization(obj)


def _set_running(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod:
    status = {
        "phase": "Running",
        "hostIP": "192.0.2.10",
        "podIP": POD_IPS[0],
        "podIPs": [{"ip": ip} for ip in POD_IPS],
    }
    return core.patch_namespaced_pod_status(name, namespace, {"status": status})


def test_pod_status_ips_round_trip(core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, _pod("web-0"))
    _set_running(core, namespace, "web-0")

    pod = core.read_namespaced_pod("web-0", namespace)
    assert pod.spec.node_name == "node-1"
    assert pod.status.phase == "Running"
    assert pod.status.pod_ip == POD_IPS[0]
    assert [p["ip"] for p in as_json(pod)["status"]["podIPs"]] == POD_IPS


def test_services_get_cluster_ips_from_both_families(core: client.CoreV1Api, namespace: str) -> None:
    spec = {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    single = core.create_namespaced_service(namespace, {"metadata": {"name": "web"}, "spec": spec})
    dual = core.create_namespaced_service(
        namespace,
        {"metadata": {"name": "web-dual"}, "spec": {**spec, "ipFamilyPolicy": "RequireDualStack"}},
    )

    assert ipaddress.ip_address(single.spec.cluster_ip) in ipaddress.ip_network("10.96.0.0/16")
    v4, v6 = (ipaddress.ip_address(ip) for ip in as_json(dual)["spec"]["clusterIPs"])
    assert v4 in ipaddress.ip_network("10.96.0.0/16")
    assert v6 in ipaddress.ip_network("fd10:96::/112")
    assert core.read_namespaced_service("web", namespace).spec.cluster_ip == single.spec.cluster_ip


def test_service_account_rbac_allows_pods_and_denies_secrets(apiserver: ApiServer, namespace: str) -> None:
    role = f"pod-reader-{namespace}"
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "exporter", "namespace": namespace}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": role},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "exporter", "namespace": namespace}],
        },
    ]
    first = apiserver.apply(docs)
    again = apiserver.apply(docs)
    # Server-side apply of unchanged docs stores nothing new.
    assert [d["metadata"]["resourceVersion"] for d in again] == [d["metadata"]["resourceVersion"] for d in first]

    with apiserver.api_client(apiserver.service_account_kubeconfig(namespace, "exporter")) as api:
        as_sa = client.CoreV1Api(api)
        as_sa.list_pod_for_all_namespaces(limit=1)
        as_sa.list_namespaced_pod(namespace)
        with pytest.raises(ApiException) as denied:
            as_sa.list_namespaced_secret(namespace)
        assert denied.value.status == 403
        with pytest.raises(ApiException) as denied:
            as_sa.create_namespaced_pod(namespace, _pod("not-allowed"))
        assert denied.value.status == 403


def test_watch_sees_added_and_modified(core: client.CoreV1Api, namespace: str) -> None:
    since = core.list_namespaced_pod(namespace).metadata.resource_version
    core.create_namespaced_pod(namespace, _pod("web-0"))
    _set_running(core, namespace, "web-0")

    seen: list[tuple[str, str | None]] = []
    w = watch.Watch()
    for event in w.stream(core.list_namespaced_pod, namespace, resource_version=since, timeout_seconds=15):
        seen.append((event["type"], event["object"].status.pod_ip))
        if event["type"] == "MODIFIED" and event["object"].status.phase == "Running":
            w.stop()
    assert seen[0] == ("ADDED", None)
    assert seen[-1] == ("MODIFIED", POD_IPS[0])


def test_dry_run_apply_validates_without_storing(apiserver: ApiServer, core: client.CoreV1Api) -> None:
    ns = f"t-dry-{uuid.uuid4().hex[:8]}"
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": ns}}
    [result] = apiserver.dry_run_apply([{**config_map, "data": {"k": "v"}}])
    assert result["data"] == {"k": "v"}
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_config_map("cfg", ns)
    assert missing.value.status == 404

    with pytest.raises(ApiException) as unknown:
        apiserver.dry_run_apply([{**config_map, "data": {"k": "v"}, "unknownField": 1}])
    # Server-side apply reports fields outside the schema as a 500 (kubernetes/kubernetes#122480).
    assert unknown.value.status in (400, 500)
    body = unknown.value.body  # bytes before kubernetes 36, str since
    assert "unknownField: field not declared in schema" in (body.decode() if isinstance(body, bytes) else body)
    with pytest.raises(ApiException) as invalid:
        apiserver.dry_run_apply([{**config_map, "metadata": {"name": "Not_A_Name", "namespace": ns}}])
    assert invalid.value.status == 422


def test_restart_keeps_data(apiserver: ApiServer, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, _pod("web-0"))
    url = apiserver.url
    try:
        apiserver.stop()
        assert not apiserver.running
        with pytest.raises(urllib3.exceptions.HTTPError):
            core.read_namespaced_pod("web-0", namespace, _request_timeout=5)
    finally:
        apiserver.start()
    assert apiserver.url == url
    # The same client carries on: its pooled connections are re-established.
    assert core.read_namespaced_pod("web-0", namespace).spec.node_name == "node-1"
