{{/* The rule groups of the PrometheusRule (prometheusrule.yaml): a Prometheus rules file's "groups". */}}
{{- define "flow-exporter.alertGroups" -}}
{{- $w := .Values.prometheusRule.rateWindow -}}
{{- $f := .Values.prometheusRule.for -}}
{{- $t := .Values.prometheusRule.thresholds -}}
groups:
  - name: flow-exporter
    rules:
      - alert: FlowExporterDown
        expr: up{ {{- .Values.prometheusRule.upSelector -}} } == 0
        for: {{ $f.down }}
        labels:
          severity: critical
        annotations:
          summary: Prometheus cannot scrape the flow exporter on {{`{{ $labels.instance }}`}}.
          description: >-
            The exporter's /metrics has not answered for {{ $f.down }}: the pod is crashing or
            restarting, or metrics.port is not reachable. No flows are exported from that node.
            Runbook: FlowExporterDown.
      - alert: FlowExporterNotReady
        expr: flow_exporter_ready == 0
        for: {{ $f.notReady }}
        labels:
          severity: warning
        annotations:
          summary: The flow exporter on {{`{{ $labels.instance }}`}} has not been ready for {{ $f.notReady }}.
          description: >-
            /readyz answers 503: the broker is not reached, records wait longer than kafka.readyTimeout
            with no delivery, the Kubernetes caches are not synced, or state.dir holds back records.
            Its log and /readyz say which. Runbook: FlowExporterNotReady.
      - alert: FlowExporterEventsLost
        expr: rate(flow_exporter_event_losses_total[{{ $w }}]) > 0
        for: {{ $f.eventsLost }}
        labels:
          severity: warning
        annotations:
          summary: The kernel drops conntrack events on {{`{{ $labels.instance }}`}}.
          description: >-
            {{`{{ $value | humanize }}`}} events/s lost (event socket buffer full): connections shorter
            than conntrack.pollInterval may go unreported. Raise conntrack.eventBufferMax, or give the
            pod more CPU (resources.limits.cpu). Runbook: FlowExporterEventsLost.
      - alert: FlowExporterConnectionsGivenUp
        expr: sum without (reason) (rate(flow_exporter_connections_given_up_total[{{ $w }}])) > 0
        for: {{ $f.connectionsGivenUp }}
        labels:
          severity: warning
        annotations:
          summary: The flow exporter on {{`{{ $labels.instance }}`}} gives connections up at limits.maxConnections.
          description: >-
            {{`{{ $value | humanize }}`}} connections/s are given up (one lack-of-resources record each,
            their later counts are lost): the node has more connections than limits.maxConnections.
            Raise limits.maxConnections (and resources.limits.memory with it).
            Runbook: FlowExporterConnectionsGivenUp.
      - alert: FlowExporterStoreNearCap
        expr: flow_exporter_connections_tracked / flow_exporter_max_connections > {{ $t.storeRatio }}
        for: {{ $f.storeNearCap }}
        labels:
          severity: warning
        annotations:
          summary: The flow exporter on {{`{{ $labels.instance }}`}} tracks {{`{{ $value | humanizePercentage }}`}} of limits.maxConnections.
          description: >-
            Past the cap, new connections are given up. Raise limits.maxConnections (and
            resources.limits.memory with it). Runbook: FlowExporterStoreNearCap.
      - alert: FlowExporterRecordsGivenUp
        expr: increase(flow_exporter_records_given_up_total[{{ $w }}]) > 0
        for: {{ $f.recordsGivenUp }}
        labels:
          severity: critical
        annotations:
          summary: Kafka refused records for good on {{`{{ $labels.instance }}`}}; their counts are lost.
          description: >-
            {{`{{ $value | humanize }}`}} records given up in {{ $w }} (a permanent error: record too
            large, topic deleted, a fatal producer error). The log names the Kafka error; check
            kafka.topic, kafka.routes and kafka.producer. Runbook: FlowExporterRecordsGivenUp.
      - alert: FlowExporterDeliveriesFailing
        expr: >-
          rate(flow_exporter_records_failed_total[{{ $w }}]) > 0
          or (flow_exporter_records_in_flight > 0
          and rate(flow_exporter_records_acknowledged_total[{{ $w }}]) == 0)
        for: {{ $f.deliveriesFailing }}
        labels:
          severity: critical
        annotations:
          summary: Deliveries to Kafka fail or stall on {{`{{ $labels.instance }}`}}.
          description: >-
            For {{ $f.deliveriesFailing }} deliveries have failed (they are retried as the same bytes) or
            records wait with none acknowledged: the broker is down or unreachable, or an ACL refuses
            the topic. flow_exporter_delivery_failures_total names the Kafka error; check
            kafka.bootstrapServers, the credentials and the topic's ACLs. Runbook: FlowExporterDeliveriesFailing.
      - alert: FlowExporterCheckpointFailing
        expr: flow_exporter_checkpoint_broken == 1
        for: {{ $f.checkpointFailing }}
        labels:
          severity: warning
        annotations:
          summary: The flow exporter on {{`{{ $labels.instance }}`}} cannot write its checkpoint (state.dir).
          description: >-
            The state directory is not kept (disk full, read-only, permissions): after a restart the
            connections start over, flagged adopted. Free space or fix the volume behind state.dir
            (stateHostPath). Runbook: FlowExporterCheckpointFailing.
      - alert: FlowExporterRecordsHeldBack
        expr: flow_exporter_checkpoint_stale == 1
        for: {{ $f.recordsHeldBack }}
        labels:
          severity: critical
        annotations:
          summary: The flow exporter on {{`{{ $labels.instance }}`}} holds records back (stale state.dir).
          description: >-
            state.dir cannot be written and still holds an old state it cannot delete; no record goes out
            until a snapshot succeeds. Make state.dir (stateHostPath) writable.
            Runbook: FlowExporterRecordsHeldBack.
      - alert: FlowExporterPollSlow
        expr: >-
          rate(flow_exporter_poll_duration_seconds_sum[{{ $w }}])
          / rate(flow_exporter_poll_duration_seconds_count[{{ $w }}])
          / flow_exporter_poll_interval_seconds > {{ $t.pollSlowRatio }}
        for: {{ $f.pollSlow }}
        labels:
          severity: warning
        annotations:
          summary: Conntrack polls on {{`{{ $labels.instance }}`}} take {{`{{ $value | humanize }}`}} times conntrack.pollInterval.
          description: >-
            Polls are slower than the interval between them: records come late and the loop is always
            busy. Raise conntrack.pollInterval, restrict conntrack.zones, or give the pod more CPU
            (resources.limits.cpu). Runbook: FlowExporterPollSlow.
      - alert: FlowExporterInFlightNearLimit
        expr: flow_exporter_records_in_flight / flow_exporter_max_in_flight > {{ $t.inFlightRatio }}
        for: {{ $f.inFlightNearLimit }}
        labels:
          severity: warning
        annotations:
          summary: Records in flight on {{`{{ $labels.instance }}`}} are at {{`{{ $value | humanizePercentage }}`}} of limits.maxInFlight.
          description: >-
            Kafka acknowledges more slowly than records are built; at the limit exports wait. Check the
            broker's health and kafka_broker_rtt_seconds; raise limits.maxInFlight if the broker keeps up.
            Runbook: FlowExporterInFlightNearLimit.
      - alert: FlowExporterConntrackTableNearFull
        expr: >-
          flow_exporter_conntrack_entries / flow_exporter_conntrack_max > {{ $t.tableRatio }}
          and flow_exporter_conntrack_max > 0
        for: {{ $f.tableNearFull }}
        labels:
          severity: warning
        annotations:
          summary: The conntrack table on {{`{{ $labels.instance }}`}} is {{`{{ $value | humanizePercentage }}`}} full.
          description: >-
            Near nf_conntrack_max the kernel drops new connections (early_drop, then drop). Raise the
            node's net.netfilter.nf_conntrack_max, or find what opens so many connections.
            Runbook: FlowExporterConntrackTableNearFull.
      - alert: FlowExporterKernelDrops
        expr: rate(flow_exporter_conntrack_kernel_total{stat=~"insert_failed|drop|early_drop"}[{{ $w }}]) > 0
        for: {{ $f.kernelDrops }}
        labels:
          severity: warning
        annotations:
          summary: Conntrack's {{`{{ $labels.stat }}`}} rises on {{`{{ $labels.instance }}`}}.
          description: >-
            The kernel's conntrack counts {{`{{ $value | humanize }}`}} {{`{{ $labels.stat }}`}}/s: packets
            or entries dropped by the kernel itself (a full table, insert races). Check the table's fill
            against net.netfilter.nf_conntrack_max. Runbook: FlowExporterKernelDrops.
      - alert: FlowExporterSilent
        expr: >-
          flow_exporter_conntrack_entries > 0
          and on (instance, job) increase(flow_exporter_records_produced_total[{{ $w }}]) == 0
        for: {{ $f.silent }}
        labels:
          severity: warning
        annotations:
          summary: The flow exporter on {{`{{ $labels.instance }}`}} exports nothing while its conntrack table is not empty.
          description: >-
            {{`{{ $value }}`}} conntrack entries and no record produced for {{ $f.silent }}: export.flows
            is off, conntrack.zones leaves every entry out, or the loops are stuck.
            Runbook: FlowExporterSilent.
{{- end -}}
