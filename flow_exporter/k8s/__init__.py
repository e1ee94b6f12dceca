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
from typing import TYPE_CHECKING

from flow_exporter.k8s.enrich import Enricher

if TYPE_CHECKING:
    from flow_exporter.config import Config

__all__ = ["Enricher", "start_enricher"]

log = logging.getLogger(__name__)


def start_enricher(cfg: Config) -> Enricher | None:
    """An enricher over caches started in the background (``enricher.caches``), per ``k8s.*``.

    None (after an error naming the reason) when no API server configuration can be loaded:
    flows are then exported unenriched rather than not at all.
    """
    from kubernetes.config import ConfigException

    from flow_exporter.k8s.cache import K8sCaches, load_configuration
    from flow_exporter.settings import MAX_POD_LABEL_KEYS

    try:
        api = load_configuration(cfg["k8s.kubeconfig"])
    except (ConfigException, OSError) as exc:
        log.error("k8s enrichment disabled: no API server configuration (%s)", exc)
        return None
    labels = cfg["k8s.podLabels"]
    caches = K8sCaches(
        api,
        scope=cfg["k8s.scope"],
        node_name=cfg.node_name,
        retention=cfg["k8s.deletedPodRetention"],
        label_keys=labels,
        backoff_initial=cfg["retry.initialBackoff"],
        backoff_max=cfg["retry.maxBackoff"],
    )
    enricher = Enricher(caches, cfg.node_name, labels, max_labels=MAX_POD_LABEL_KEYS)
    log.info("k8s enrichment: scope %s, API server %s", caches.scope, api.host)
    caches.start()
    return enricher
