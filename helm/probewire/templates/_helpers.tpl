{{/*
Names, labels and the pieces every probewire pod shares.
*/}}

{{/* Chart name, overridable. */}}
{{- define "probewire.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix: "<release>-<chart>", or the release name when it already contains the chart name. */}}
{{- define "probewire.fullname" -}}
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

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "probewire.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select a component's pods; call with (dict "root" $ "component" "worker"). */}}
{{- define "probewire.selectorLabels" -}}
app.kubernetes.io/name: {{ include "probewire.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Standard labels of every resource; call with (dict "root" $ "component" "worker"). */}}
{{- define "probewire.labels" -}}
helm.sh/chart: {{ include "probewire.chart" .root }}
{{ include "probewire.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: probewire
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Image reference of a component ("worker" or "evaluator"); call with (dict "root" $ "component" "worker"). */}}
{{- define "probewire.image" -}}
{{- $image := index .root.Values.image .component }}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/* Where the config file, the TLS CAs and the scratch space live in every container. */}}
{{- define "probewire.configDir" -}}/etc/probewire{{- end }}
{{- define "probewire.configPath" -}}/etc/probewire/config.yaml{{- end }}
{{- define "probewire.kafkaCaPath" -}}/etc/probewire/tls/kafka/ca.crt{{- end }}
{{- define "probewire.clickhouseCaPath" -}}/etc/probewire/tls/clickhouse/ca.crt{{- end }}
{{- define "probewire.workDir" -}}/var/lib/probewire{{- end }}

{{/*
Refuse configurations that would deploy but not work, with a message that names the values.
*/}}
{{- define "probewire.validate" -}}
{{- $s := .Values.settings }}
{{- $partitions := int $s.topics.partitions }}
{{- if gt (int .Values.worker.replicas) $partitions }}
{{- fail (printf "worker.replicas (%d) exceeds settings.topics.partitions (%d): a Faust worker beyond the partition count gets no partition and idles; lower worker.replicas or raise settings.topics.partitions" (int .Values.worker.replicas) $partitions) }}
{{- end }}
{{- if and .Values.evaluator.enabled (gt (int .Values.evaluator.replicas) $partitions) }}
{{- fail (printf "evaluator.replicas (%d) exceeds settings.topics.partitions (%d): an evaluator beyond the partition count of the checkpoints topic idles; lower evaluator.replicas or raise settings.topics.partitions" (int .Values.evaluator.replicas) $partitions) }}
{{- end }}
{{- if regexMatch "^[A-Za-z+]+://[^/]*@" $s.clickhouse.url }}
{{- fail "settings.clickhouse.url carries credentials (user:password@host): they would be rendered into the ConfigMap; set settings.clickhouse.username and put the password in the Secret named by secrets.clickhouse" }}
{{- end }}
{{- if hasPrefix "chdb:" $s.clickhouse.url }}
{{- fail "settings.clickhouse.url: the embedded chdb:/// engine is one process per local directory and cannot serve a Deployment; point it at a ClickHouse server (http:// or https://)" }}
{{- end }}
{{- if and (hasPrefix "SASL" $s.kafka.security_protocol) (not .Values.secrets.kafkaSasl.existingSecret) }}
{{- fail (printf "settings.kafka.security_protocol is %s but secrets.kafkaSasl.existingSecret is empty: create a Secret holding the SASL password and name it there" $s.kafka.security_protocol) }}
{{- end }}
{{- if and .Values.tls.kafka.existingSecret (not (has $s.kafka.security_protocol (list "SSL" "SASL_SSL"))) }}
{{- fail (printf "tls.kafka.existingSecret is set but settings.kafka.security_protocol is %s, which does not use TLS; use SSL or SASL_SSL" $s.kafka.security_protocol) }}
{{- end }}
{{- if and .Values.tls.clickhouse.existingSecret (not (hasPrefix "https://" $s.clickhouse.url)) }}
{{- fail "tls.clickhouse.existingSecret is set but settings.clickhouse.url is not https://; the CA would be unused" }}
{{- end }}
{{- if $s.stream.alert_webhook_url }}
{{- fail "settings.stream.alert_webhook_url would be rendered into the ConfigMaps, where whoever reads them reads the token in it: leave it empty, put the URL in a Secret and name it in secrets.alertWebhook.existingSecret" }}
{{- end }}
{{- if not (regexMatch "^([A-Za-z_][A-Za-z0-9_]*)?$" (toString (.Values.dashboards.datasource.passwordEnv | default ""))) }}
{{- fail "dashboards.datasource.passwordEnv must name an environment variable of Grafana's (letters, digits and _, not a digit first), not hold the password: put the password in Grafana's environment and name the variable here" }}
{{- end }}
{{- if and (hasKey $s.evaluator "enabled") (ne $s.evaluator.enabled .Values.evaluator.enabled) }}
{{- fail "settings.evaluator.enabled disagrees with evaluator.enabled; set only evaluator.enabled (the chart copies it into the settings)" }}
{{- end }}
{{- end }}

{{/*
The settings tree written to config.yaml: .Values.settings plus what the chart derives
(the evaluator switch, the mounted Kafka CA). Only names of secret env vars, never values.
*/}}
{{- define "probewire.configYaml" -}}
{{- $s := deepCopy .Values.settings }}
{{- $_ := set $s.evaluator "enabled" .Values.evaluator.enabled }}
{{- if and .Values.tls.kafka.existingSecret (not $s.kafka.ssl_ca_location) }}
{{- $_ := set $s.kafka "ssl_ca_location" (include "probewire.kafkaCaPath" .) }}
{{- end }}
{{- toYaml $s }}
{{- end }}

{{/* Pod-level fields shared by every probewire pod. */}}
{{- define "probewire.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* Environment of every probewire container: the config path, writable caches, secret references. */}}
{{- define "probewire.env" -}}
- name: PROBEWIRE_CONFIG
  value: {{ include "probewire.configPath" . }}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: MPLCONFIGDIR
  value: /tmp/matplotlib
{{- with .Values.secrets.kafkaSasl.existingSecret }}
- name: {{ $.Values.settings.kafka.sasl_password_env }}
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.secrets.kafkaSasl.passwordKey }}
{{- end }}
{{- with .Values.secrets.clickhouse.existingSecret }}
- name: {{ $.Values.settings.clickhouse.password_env }}
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.secrets.clickhouse.passwordKey }}
{{- end }}
{{- if .Values.tls.clickhouse.existingSecret }}
- name: SSL_CERT_FILE
  value: {{ include "probewire.clickhouseCaPath" . }}
{{- end }}
{{- end }}

{{/* Volume mounts of every probewire container; call with (dict "root" $ "config" "<configmap name>"). */}}
{{- define "probewire.volumeMounts" -}}
- name: config
  mountPath: {{ include "probewire.configDir" .root }}/config.yaml
  subPath: config.yaml
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: data
  mountPath: {{ include "probewire.workDir" .root }}
{{- if .root.Values.tls.kafka.existingSecret }}
- name: kafka-ca
  mountPath: {{ include "probewire.configDir" .root }}/tls/kafka
  readOnly: true
{{- end }}
{{- if .root.Values.tls.clickhouse.existingSecret }}
- name: clickhouse-ca
  mountPath: {{ include "probewire.configDir" .root }}/tls/clickhouse
  readOnly: true
{{- end }}
{{- end }}

{{/* Volumes matching probewire.volumeMounts; call with (dict "root" $ "config" "<configmap name>"). */}}
{{- define "probewire.volumes" -}}
- name: config
  configMap:
    name: {{ .config }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .root.Values.scratch.tmpSizeLimit }}
- name: data
  emptyDir:
    sizeLimit: {{ .root.Values.scratch.dataSizeLimit }}
{{- with .root.Values.tls.kafka.existingSecret }}
- name: kafka-ca
  secret:
    secretName: {{ . }}
    defaultMode: 0444
    items:
      - key: {{ $.root.Values.tls.kafka.caKey }}
        path: ca.crt
{{- end }}
{{- with .root.Values.tls.clickhouse.existingSecret }}
- name: clickhouse-ca
  secret:
    secretName: {{ . }}
    defaultMode: 0444
    items:
      - key: {{ $.root.Values.tls.clickhouse.caKey }}
        path: ca.crt
{{- end }}
{{- end }}

{{/* Startup, liveness and readiness probes of a component; call with (dict "root" $ "component" "worker"). */}}
{{- define "probewire.probes" -}}
{{- $command := list "probewire" "health" "--component" .component }}
{{- range $kind := list "startup" "liveness" "readiness" }}
{{- $probe := index $.root.Values.probes $kind }}
{{ $kind }}Probe:
  exec:
    command:
      {{- toYaml $command | nindent 6 }}
  periodSeconds: {{ $probe.periodSeconds }}
  timeoutSeconds: {{ $probe.timeoutSeconds }}
  failureThreshold: {{ $probe.failureThreshold }}
{{- end }}
{{- end }}
