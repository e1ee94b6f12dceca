"""Kubernetes enrichment: pod, node and Service names (and flowType) for flow records.

* :mod:`flow_exporter.k8s.index`: pure indexes keyed by packed addresses (pod IP with a short
  history for reused IPs, Service IP+port+protocol, node addresses and pod CIDRs);
* :mod:`flow_exporter.k8s.cache`: one list+watch thread per resource keeping those indexes current;
* :mod:`flow_exporter.k8s.enrich`: the store's ``on_new`` hook that reads them.

Enrichment never blocks export: caches start in the background, and with the API server down
records keep flowing, enriched from the last known state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from flow_exporter.k8s.enrich import Enricher

if TYPE_CHECKING:
    from flow_exporter.settings import Settings

__all__ = ["Enricher", "api_configuration", "start_enricher"]

log = logging.getLogger(__name__)


def api_configuration(settings: Settings) -> Any:
    """The API server client settings ``k8s.*`` name; a ConfigError (exit code 2) when there are none.

    Asked for enrichment and given no usable configuration, the exporter stops at start rather
    than run for weeks without the pod names its users expect (the API server being down later
    is different: records keep flowing, enriched from the last known state).
    """
    from kubernetes.config import ConfigException

    from flow_exporter.k8s.cache import load_configuration
    from flow_exporter.settings import ConfigError

    path = settings.k8s.kubeconfig
    try:
        return load_configuration(path)
    except (ConfigException, OSError) as exc:
        where = "k8s.kubeconfig" if path else "k8s.enabled"
        raise ConfigError(
            where,
            path if path else True,
            f"no usable API server configuration ({'that file' if path else 'in-cluster or ~/.kube/config'}: "
            f"{getattr(exc, 'strerror', None) or exc})",
        ) from None


def start_enricher(settings: Settings, api: Any) -> Enricher:
    """An enricher over caches started in the background (``enricher.caches``), per ``k8s.*``."""
    from flow_exporter.config import this_node
    from flow_exporter.k8s.cache import K8sCaches
    from flow_exporter.settings import MAX_POD_LABEL_KEYS

    k8s, node = settings.k8s, this_node(settings)
    caches = K8sCaches(
        api,
        scope=k8s.scope,
        node_name=node,
        retention=k8s.deleted_pod_retention,
        label_keys=k8s.pod_labels,
        backoff_initial=settings.retry.initial_backoff,
        backoff_max=settings.retry.max_backoff,
    )
    enricher = Enricher(caches, node, k8s.pod_labels, max_labels=MAX_POD_LABEL_KEYS)
    log.info("k8s enrichment: scope %s, API server %s", caches.scope, api.host)
    caches.start()
    return enricher
