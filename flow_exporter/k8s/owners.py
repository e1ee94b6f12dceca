"""Workload owners: which Deployment, StatefulSet, DaemonSet, CronJob or Job a pod belongs to.

Pod names change with every rollout; their owners do not, so records name the owner (the
``*OwnerKind`` and ``*OwnerName`` fields) for a downstream job to group a day of flows by.
A pod's controller reference names its direct owner; two kinds are one step further down than
users think of them: a ReplicaSet belongs to its Deployment, a Job to its CronJob. So the
ReplicaSets and Jobs of the cluster are listed and watched, and of each only its own controller
reference is kept: (namespace, name) -> (kind, name), a few dozen bytes per object. A pod whose
ReplicaSet or Job is not known (yet, or ever: a bare ReplicaSet) is attributed to that direct
owner; a pod without a controller is its own workload (kind ``Pod``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["OwnerIndex", "controller_of", "workload"]

Owner = tuple[str, str]  # (kind, name), in the owned object's namespace


def controller_of(meta: Mapping[str, Any]) -> Owner | None:
    """The object's managing controller from ``metadata.ownerReferences`` (the one with ``controller: true``)."""
    for ref in meta.get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("controller") and ref.get("kind") and ref.get("name"):
            return sys.intern(str(ref["kind"])), str(ref["name"])
    return None


class OwnerIndex:
    """ReplicaSets (or Jobs) of the cluster: (namespace, name) -> their controller, nothing else kept.

    ``version`` grows when a mapping is added, changed or removed (not on the status updates that
    make most watch events), so memoized record fields built from it can tell they are stale.
    """

    def __init__(self) -> None:
        # (namespace, name) -> (object key, its controller): the key tells whose entry it is
        self.owners: dict[tuple[str, str], tuple[str, Owner | None]] = {}
        self._keys: dict[str, tuple[str, str]] = {}  # object key (uid) -> (namespace, name)
        self.version = 0

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> set[str]:
        return set(self._keys)

    def get(self, namespace: str, name: str) -> Owner | None:
        entry = self.owners.get((namespace, name))
        return entry[1] if entry is not None else None

    def apply(self, event: str, obj: Mapping[str, Any], now: int) -> None:
        if event == "DELETED":
            self.delete(_key(obj), now)
        else:
            self.upsert(obj, now)

    def upsert(self, obj: Mapping[str, Any], now: int = 0, exact: bool = True) -> str:
        meta = obj.get("metadata") or {}
        key = _key(obj)
        where = (sys.intern(meta.get("namespace") or ""), str(meta.get("name") or ""))
        owner = controller_of(meta)
        old = self.owners.get(where)
        if old is None or old[1] != owner:
            self.version += 1
        self.owners[where] = (key, owner)
        self._keys[key] = where
        return key

    def delete(self, key: str, now: int = 0, exact: bool = True) -> None:
        where = self._keys.pop(key, None)
        entry = self.owners.get(where) if where is not None else None
        # only its own entry: an object recreated under its name (new uid) may be upserted before this DELETED
        if where is not None and entry is not None and entry[0] == key:
            del self.owners[where]
            self.version += 1

    def prune(self, now: int) -> int:
        return 0


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace', '')}/{meta.get('name', '')}")


def workload(namespace: str, pod_name: str, owner: Owner | None, replicasets: OwnerIndex, jobs: OwnerIndex) -> Owner:
    """The (kind, name) a user groups this pod by: Deployment via its ReplicaSet, CronJob via its Job, ..."""
    if owner is None:
        return "Pod", pod_name
    kind, name = owner
    if kind == "ReplicaSet":
        up = replicasets.get(namespace, name)
        return up if up is not None and up[0] == "Deployment" else owner
    if kind == "Job":
        up = jobs.get(namespace, name)
        return up if up is not None and up[0] == "CronJob" else owner
    return owner
