{{/* Chart name, truncated to the 63 characters DNS labels allow. */}}
{{- define "conveyor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Release-qualified name. Shorter than 63 so that "<fullname>-worker-<ordinal>" stays a valid
pod name and hostname.
*/}}
{{- define "conveyor.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "conveyor.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "conveyor.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels every pod of the release carries: the NetworkPolicy trusts them. */}}
{{- define "conveyor.releaseSelector" -}}
app.kubernetes.io/name: {{ include "conveyor.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component: include "conveyor.selector" (list . "worker") */}}
{{- define "conveyor.selector" -}}
{{ include "conveyor.releaseSelector" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "conveyor.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{- define "conveyor.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "conveyor.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "conveyor.modelDir" -}}
{{- default (printf "/models/%s" .Values.model.name) .Values.model.dir }}
{{- end }}

{{/* Pipelines (docs/scale-out.md): one scheduler and one worker set each. */}}
{{- define "conveyor.pipelines" -}}
{{- $n := int (default 1 .Values.pipelines) -}}
{{- if lt $n 1 }}{{ fail "pipelines must be >= 1" }}{{ end -}}
{{ $n }}
{{- end }}

{{/* Name suffix of pipeline p: "" alone (names as before), "-p<p>" among several:
include "conveyor.pipelineSuffix" (list . p) */}}
{{- define "conveyor.pipelineSuffix" -}}
{{- if gt (int (include "conveyor.pipelines" (index . 0))) 1 -}}-p{{ index . 1 }}{{- end -}}
{{- end }}

{{/* The pipeline label of pipeline p's pods and selectors (none when alone). */}}
{{- define "conveyor.pipelineLabel" -}}
{{- if gt (int (include "conveyor.pipelines" (index . 0))) 1 -}}
conveyor.io/pipeline: p{{ index . 1 }}
{{- end -}}
{{- end }}

{{/* Worker StatefulSet of pipeline p: include "conveyor.workerName" (list . p); "." alone
means pipeline 0. */}}
{{- define "conveyor.workerName" -}}
{{- if kindIs "slice" . -}}
{{ include "conveyor.fullname" (index . 0) }}-worker{{ include "conveyor.pipelineSuffix" . }}
{{- else -}}
{{ include "conveyor.workerName" (list . 0) }}
{{- end -}}
{{- end }}

{{/* DNS name of worker pod i (stage i / T, tp rank i % T) of pipeline p (default 0):
include "conveyor.workerHost" (list . i p) */}}
{{- define "conveyor.workerHost" -}}
{{- $root := index . 0 -}}
{{- $p := 0 -}}
{{- if gt (len .) 2 }}{{ $p = index . 2 }}{{ end -}}
{{- $name := include "conveyor.workerName" (list $root $p) -}}
{{ $name }}-{{ index . 1 }}.{{ $name }}.{{ $root.Release.Namespace }}.svc.{{ $root.Values.clusterDomain }}
{{- end }}

{{/* Comma-separated gRPC addresses of every worker pod of pipeline p, stage-major: stage 0
first, and with tensor parallelism every rank of a stage before the next stage (the
scheduler's --workers): include "conveyor.workerAddrs" (list . p); "." means pipeline 0. */}}
{{- define "conveyor.workerAddrs" -}}
{{- $root := . -}}
{{- $p := 0 -}}
{{- if kindIs "slice" . }}{{ $root = index . 0 }}{{ $p = index . 1 }}{{ end -}}
{{- $addrs := list -}}
{{- $tp := int (default 1 $root.Values.pipeline.tensorParallelSize) -}}
{{- range $i := until (mul (int $root.Values.pipeline.stages) $tp | int) -}}
{{- $addrs = append $addrs (printf "%s:%d" (include "conveyor.workerHost" (list $root $i $p)) (int $root.Values.worker.port)) -}}
{{- end -}}
{{ join "," $addrs }}
{{- end }}

{{/* The scheduler Service of pipeline p: include "conveyor.schedulerName" (list . p) */}}
{{- define "conveyor.schedulerName" -}}
{{ include "conveyor.fullname" (index . 0) }}-scheduler{{ include "conveyor.pipelineSuffix" . }}
{{- end }}

{{/* DNS name of pipeline p's scheduler: include "conveyor.schedulerHost" (list . p); "."
means pipeline 0. */}}
{{- define "conveyor.schedulerHost" -}}
{{- $root := . -}}
{{- $p := 0 -}}
{{- if kindIs "slice" . }}{{ $root = index . 0 }}{{ $p = index . 1 }}{{ end -}}
{{ include "conveyor.schedulerName" (list $root $p) }}.{{ $root.Release.Namespace }}.svc.{{ $root.Values.clusterDomain }}
{{- end }}

{{/* Every pipeline's scheduler HOST:PORT, comma-separated (the router's --schedulers). */}}
{{- define "conveyor.schedulerAddrs" -}}
{{- $addrs := list -}}
{{- range $p := until (int (include "conveyor.pipelines" .)) -}}
{{- $addrs = append $addrs (printf "%s:%d" (include "conveyor.schedulerHost" (list $ $p)) (int $.Values.scheduler.port)) -}}
{{- end -}}
{{ join "," $addrs }}
{{- end }}

{{- define "conveyor.redisSecretName" -}}
{{- default (printf "%s-redis" (include "conveyor.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{- define "conveyor.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "conveyor.fullname" . }}-redis.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.redis.port }}/0
{{- else -}}
{{- required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url -}}
{{- end -}}
{{- end }}

{{/* The Redis password, always from a Secret. */}}
{{- define "conveyor.redisPasswordEnv" -}}
- name: CONVEYOR_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "conveyor.redisSecretName" . }}
      key: {{ .Values.redis.auth.existingSecretPasswordKey }}
{{- end }}

{{/* The Secret holding the internal token. */}}
{{- define "conveyor.internalTokenSecretName" -}}
{{- default (printf "%s-internal-token" (include "conveyor.fullname" .)) .Values.security.internalToken.existingSecret }}
{{- end }}

{{/* The internal token of every Conveyor service, always from a Secret. */}}
{{- define "conveyor.internalTokenEnv" -}}
- name: CONVEYOR_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "conveyor.internalTokenSecretName" . }}
      key: {{ .Values.security.internalToken.key }}
{{- end }}

{{- define "conveyor.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "conveyor.fullname" .)) .Values.security.tls.existingSecret }}
{{- end }}

{{/* TLS and mutual TLS flags of a Conveyor service (the Secret is mounted at /tls). */}}
{{- define "conveyor.tlsArgs" -}}
{{- if .Values.security.tls.enabled }}
- --tls-cert=/tls/tls.crt
- --tls-key=/tls/tls.key
- --tls-ca=/tls/ca.crt
- --health-port={{ .Values.security.tls.healthPort }}
{{- end }}
{{- end }}

{{- define "conveyor.tlsVolume" -}}
{{- if .Values.security.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "conveyor.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "conveyor.tlsMount" -}}
{{- if .Values.security.tls.enabled }}
- name: tls
  mountPath: /tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "conveyor.healthPortSpec" -}}
{{- if .Values.security.tls.enabled }}
- name: health
  containerPort: {{ .Values.security.tls.healthPort }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* The port the probes ask: the gRPC port, or the plaintext health port under TLS:
include "conveyor.probePort" (list . grpcPort) */}}
{{- define "conveyor.probePort" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.security.tls.enabled -}}
{{ $root.Values.security.tls.healthPort }}
{{- else -}}
{{ index . 1 }}
{{- end -}}
{{- end }}

{{/*
The model volume and, without an existing claim, the init container that fetches into it.
*/}}
{{- define "conveyor.modelVolume" -}}
- name: models
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.fetch.emptyDirSizeLimit }}
{{- end }}
{{- end }}

{{- define "conveyor.modelFetchInit" -}}
{{- if not .Values.model.existingClaim }}
initContainers:
  - name: model-fetch
    image: {{ include "conveyor.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args: ["models", "fetch", {{ .Values.model.name | quote }}, "--dir", "/models"]
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    resources:
      {{- toYaml .Values.model.fetch.resources | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: /models
{{- end }}
{{- end }}

{{- define "conveyor.modelMount" -}}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}

{{/* Native gRPC probes on a Conveyor service's port (grpc.health.v1). Readiness asks the
server's overall status ("": SERVING once it can serve, e.g. the router only while the
pipeline is whole); startup and liveness ask "liveness", SERVING while the process runs, so a
broken pipeline makes pods unready, never restarts them. */}}
{{- define "conveyor.grpcProbes" -}}
{{- $port := index . 0 -}}
{{- $startupFailures := index . 1 -}}
startupProbe:
  grpc:
    port: {{ $port }}
    service: liveness
  periodSeconds: 10
  failureThreshold: {{ $startupFailures }}
readinessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ $port }}
    service: liveness
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{/*
The router's probes with the HTTP API on: ready while GET /health answers 200 (the scheduler is
SERVING), started and alive as the gRPC `liveness` service says (the same process serves both).
include "conveyor.routerHttpProbes" (list . grpcProbePort)
*/}}
{{- define "conveyor.routerHttpProbes" -}}
{{- $root := index . 0 -}}
{{- $port := index . 1 -}}
startupProbe:
  grpc:
    port: {{ $port }}
    service: liveness
  periodSeconds: 10
  failureThreshold: 30
readinessProbe:
  httpGet:
    path: /health
    port: http
    scheme: {{ ternary "HTTPS" "HTTP" $root.Values.security.tls.enabled }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ $port }}
    service: liveness
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{- define "conveyor.metricsArgs" -}}
{{- if .Values.metrics.enabled }}
- --metrics-port={{ .Values.metrics.port }}
{{- end }}
{{- end }}

{{- define "conveyor.metricsPort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* Pod labels of components that serve metrics: the metrics Service selects them. */}}
{{- define "conveyor.metricsLabel" -}}
{{- if .Values.metrics.enabled }}
conveyor.dev/metrics: "true"
{{- end }}
{{- end }}

{{/*
A worker's --threads: worker.threads when set; else, on CPU without a CPU limit (a worker
reads its limit itself), the CPU request in whole CPUs (at least 1), since a container sees
every core of its node; else nothing (the worker's default).
*/}}
{{- define "conveyor.workerThreads" -}}
{{- $resources := .Values.worker.resources | default dict }}
{{- if .Values.worker.threads }}
{{- .Values.worker.threads }}
{{- else if and (eq .Values.pipeline.device "cpu") (not (dig "limits" "cpu" "" $resources)) }}
{{- with (dig "requests" "cpu" "" $resources | toString) }}
{{- if hasSuffix "m" . }}
{{- max 1 (div (trimSuffix "m" . | atoi) 1000) }}
{{- else }}
{{- max 1 (. | float64 | floor | int) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
