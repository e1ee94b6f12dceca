{{/* The name of every object: the release name when it already says flow-exporter. */}}
{{- define "flow-exporter.fullname" -}}
{{- if contains "flow-exporter" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-flow-exporter" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "flow-exporter.selectorLabels" -}}
app.kubernetes.io/name: flow-exporter
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "flow-exporter.labels" -}}
{{ include "flow-exporter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: flow-exporter
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
