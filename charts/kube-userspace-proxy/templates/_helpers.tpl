{{/* Chart name, overridable with nameOverride. */}}
{{- define "kup.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified name: fullnameOverride, else the release name (containing the chart name) or release-chart. */}}
{{- define "kup.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kup.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels on every object. */}}
{{- define "kup.labels" -}}
helm.sh/chart: {{ include "kup.chart" . }}
{{ include "kup.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: node-proxy
app.kubernetes.io/part-of: {{ include "kup.name" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the DaemonSet's pods (immutable once installed). */}}
{{- define "kup.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kup.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kup.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kup.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The port of a host:port bind address ("" when the address is empty or "0"). */}}
{{- define "kup.portOf" -}}
{{- $address := toString . }}
{{- if and $address (ne $address "0") }}
{{- regexFind "[0-9]+$" $address }}
{{- end }}
{{- end }}

{{/* True ("true") when a bind address only listens on loopback. */}}
{{- define "kup.loopbackOnly" -}}
{{- $address := toString . }}
{{- if or (hasPrefix "127." $address) (hasPrefix "[::1]" $address) (hasPrefix "localhost" $address) }}true{{ end }}
{{- end }}

{{- define "kup.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Fails the render when Prometheus could not reach the metrics address. */}}
{{- define "kup.requireScrapableMetrics" -}}
{{- $address := toString .Values.config.metricsBindAddress }}
{{- if not (include "kup.portOf" $address) }}
{{- fail "serviceMonitor/podMonitor need config.metricsBindAddress set, e.g. 0.0.0.0:10249" }}
{{- end }}
{{- if include "kup.loopbackOnly" $address }}
{{- fail "serviceMonitor/podMonitor need config.metricsBindAddress off loopback, e.g. 0.0.0.0:10249" }}
{{- end }}
{{- end }}

{{/* "true" when a rolling update starts the new pod beside the old one (maxSurge). */}}
{{- define "kup.surge" -}}
{{- if and (eq (.Values.updateStrategy.type | default "RollingUpdate") "RollingUpdate") (dig "rollingUpdate" "maxSurge" 0 .Values.updateStrategy) -}}
true
{{- end -}}
{{- end }}
