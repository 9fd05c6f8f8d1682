{{/*
Names, labels and small shared fragments of the elastic-train chart.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "etrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: "<release>-<chart>", or just the release name when it
already contains the chart name, or fullnameOverride. At most 63 characters.
*/}}
{{- define "etrain.fullname" -}}
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
{{- define "etrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels that select this release's pods (stable across upgrades). */}}
{{- define "etrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "etrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The Kubernetes recommended labels, put on every resource. */}}
{{- define "etrain.labels" -}}
helm.sh/chart: {{ include "etrain.chart" . }}
{{ include "etrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: elastic-train
{{- end }}

{{/* Selector labels of the API pods. */}}
{{- define "etrain.api.selectorLabels" -}}
{{ include "etrain.selectorLabels" . }}
app.kubernetes.io/component: api
{{- end }}

{{/* Selector labels of every Ray pod (head and workers) of this release. */}}
{{- define "etrain.ray.selectorLabels" -}}
{{ include "etrain.selectorLabels" . }}
app.kubernetes.io/component: ray
{{- end }}

{{/* The ServiceAccount the API pods run as. */}}
{{- define "etrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "etrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The service image, "repository:tag" (tag defaults to the chart's appVersion). */}}
{{- define "etrain.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{/*
An image for Ray pods: the given {repository, tag} falls back, field by field, to the
service image, because Ray workers import the project's own packages (jobs/, elastic/).
Call with (dict "root" $ "image" <image values>).
*/}}
{{- define "etrain.rayImage" -}}
{{- $img := .image | default dict }}
{{- $repo := $img.repository | default .root.Values.ray.kuberay.image.repository | default .root.Values.image.repository }}
{{- $tag := $img.tag | default .root.Values.ray.kuberay.image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- printf "%s:%s" $repo ($tag | toString) }}
{{- end }}

{{/* Name of the Secret holding the API bearer token, and its key. */}}
{{- define "etrain.apiTokenSecretName" -}}
{{- default (printf "%s-api-token" (include "etrain.fullname" .)) .Values.auth.existingSecret }}
{{- end }}
{{- define "etrain.apiTokenSecretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey }}{{ else }}api-token{{ end }}
{{- end }}

{{/* True ("true") when the store is PostgreSQL (or any URL) rather than SQLite. */}}
{{- define "etrain.externalDatabase" -}}
{{- if or .Values.database.url .Values.database.existingSecret }}true{{ end }}
{{- end }}

{{/* Name of the Secret holding the database URL, and its key. */}}
{{- define "etrain.databaseSecretName" -}}
{{- default (printf "%s-database" (include "etrain.fullname" .)) .Values.database.existingSecret }}
{{- end }}
{{- define "etrain.databaseSecretKey" -}}
{{- if .Values.database.existingSecret }}{{ .Values.database.existingSecretKey }}{{ else }}database-url{{ end }}
{{- end }}

{{/* Name of the PVC of the data directory (SQLite file). */}}
{{- define "etrain.dataClaimName" -}}
{{- default (printf "%s-data" (include "etrain.fullname" .)) .Values.persistence.existingClaim }}
{{- end }}

{{/* True when checkpoints live on the shared ReadWriteMany volume (no storageUri). */}}
{{- define "etrain.checkpointVolume" -}}
{{- if and (not .Values.checkpoints.storageUri) .Values.checkpoints.persistence.enabled }}true{{ end }}
{{- end }}

{{/* Name of the shared checkpoint PVC. */}}
{{- define "etrain.checkpointClaimName" -}}
{{- default (printf "%s-checkpoints" (include "etrain.fullname" .)) .Values.checkpoints.persistence.existingClaim }}
{{- end }}

{{/* What ETRAIN_CHECKPOINT_DIR is set to. */}}
{{- define "etrain.checkpointDir" -}}
{{- if .Values.checkpoints.storageUri }}
{{- .Values.checkpoints.storageUri }}
{{- else if .Values.checkpoints.persistence.enabled }}
{{- .Values.checkpoints.mountPath }}
{{- end }}
{{- end }}

{{/*
Name of the RayCluster. KubeRay names the head Service "<name>-head-svc" and pods
"<name>-<group>-worker-xxxxx", so the name is kept short (at most 44 characters).
*/}}
{{- define "etrain.rayClusterName" -}}
{{- printf "%s-ray" (include "etrain.fullname" . | trunc 40 | trimSuffix "-") }}
{{- end }}

{{/* The head Service KubeRay creates for the RayCluster. */}}
{{- define "etrain.rayHeadService" -}}
{{- printf "%s-head-svc" (include "etrain.rayClusterName" .) }}
{{- end }}

{{/*
Secret holding the Ray auth token (data key "auth_token", the key KubeRay reads). When the
chart makes it, it is named like the RayCluster: the name KubeRay itself would use.
*/}}
{{- define "etrain.rayTokenSecretName" -}}
{{- default (include "etrain.rayClusterName" .) .Values.ray.kuberay.auth.existingSecret }}
{{- end }}

{{/* ETRAIN_RAY_ADDRESS: where the service finds Ray as a driver. Empty for embedded. */}}
{{- define "etrain.rayAddress" -}}
{{- if eq .Values.ray.mode "kuberay" }}
{{- $host := printf "%s.%s.svc" (include "etrain.rayHeadService" .) .Release.Namespace }}
{{- if eq .Values.ray.kuberay.connection "client" }}
{{- printf "ray://%s:%d" $host (int .Values.ray.kuberay.ports.client) }}
{{- else }}
{{- printf "%s:%d" $host (int .Values.ray.kuberay.ports.gcs) }}
{{- end }}
{{- else if eq .Values.ray.mode "external" }}
{{- .Values.ray.external.address }}
{{- end }}
{{- end }}

{{/*
Refusals that the schema cannot word well. Included by every template that depends on
them, so that a wrong combination fails the render with one clear sentence.
*/}}
{{- define "etrain.validate" -}}
{{- $replicas := int .Values.replicaCount }}
{{- if and (gt $replicas 1) (not (include "etrain.externalDatabase" .)) }}
{{- fail (printf "replicaCount is %d but the store is SQLite, which allows one replica only: set database.url or database.existingSecret (PostgreSQL) to run more than one." $replicas) }}
{{- end }}
{{- if and (gt $replicas 1) (eq .Values.ray.mode "embedded") }}
{{- fail (printf "replicaCount is %d but ray.mode is embedded: each replica would start its own Ray. Use ray.mode kuberay or external to run more than one." $replicas) }}
{{- end }}
{{- if and (eq .Values.ray.mode "external") (not .Values.ray.external.address) }}
{{- fail "ray.mode is external but ray.external.address is empty: set it, e.g. ray://ray-head.ray.svc:10001." }}
{{- end }}
{{- if and .Values.checkpoints.storageUri (not .Values.checkpoints.credentialsSecret) }}
{{- fail (printf "checkpoints.storageUri is %s but checkpoints.credentialsSecret is empty: name the Secret that holds the store's credentials (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, and AWS_ENDPOINT_URL for a store other than AWS)." .Values.checkpoints.storageUri) }}
{{- end }}
{{- if and (eq .Values.ray.mode "kuberay") (not .Values.checkpoints.persistence.enabled) (not .Values.checkpoints.storageUri) }}
{{- fail "ray.mode is kuberay but checkpoints have nowhere shared to go: set checkpoints.storageUri (a bucket) or enable checkpoints.persistence (a ReadWriteMany volume)." }}
{{- end }}
{{- if and (eq .Values.ray.mode "kuberay") .Values.networkPolicy.enabled .Values.ray.kuberay.dashboard.ingress.enabled (not .Values.ray.kuberay.dashboard.allowFrom) }}
{{- fail "ray.kuberay.dashboard.ingress.enabled is true but ray.kuberay.dashboard.allowFrom is empty: the NetworkPolicy would block the ingress controller. List its pods/namespace there." }}
{{- end }}
{{- if and (eq .Values.ray.mode "kuberay") .Values.ray.kuberay.gcsFaultTolerance.enabled (not .Values.ray.kuberay.gcsFaultTolerance.redisAddress) }}
{{- fail "ray.kuberay.gcsFaultTolerance.enabled is true but its redisAddress is empty: set it to the Redis that keeps the head's state, e.g. redis-master.redis.svc:6379." }}
{{- end }}
{{- if and (eq .Values.ray.mode "kuberay") (not .Values.ray.kuberay.workerGroups) }}
{{- fail "ray.mode is kuberay but ray.kuberay.workerGroups is empty: give at least one worker group." }}
{{- end }}
{{- end }}

{{/* securityContext of the Ray containers. */}}
{{- define "etrain.ray.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .Values.ray.kuberay.readOnlyRootFilesystem }}
capabilities:
  drop: ["ALL"]
{{- end }}

{{/*
Env of every Ray container: Ray token auth, a writable HOME, extra env.
*/}}
{{- define "etrain.ray.env" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "etrain.rayTokenSecretName" . }}
      key: auth_token
- name: HOME
  value: /tmp
{{- /* A lost node declared dead in about 3 s, as jobs/launcher.py's FAST_FAILURE_DETECTION
  for the service's own Ray: Ray's defaults take a minute for a node cut off, its packets
  dropped, during which a restart-mode job's workers wait on it. */}}
- name: RAY_health_check_period_ms
  value: "1000"
- name: RAY_health_check_timeout_ms
  value: "1000"
- name: RAY_health_check_failure_threshold
  value: "3"
{{- /* Every Ray worker process runs elastic/process_setup.py's hook first, as on the
  service's own Ray (jobs/launcher.py's worker_setup): its serialization context without
  Ray's add-ons for types our processes never send, 25 MB less per process. */}}
- name: __RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR
  value: elastic.process_setup.set_up
{{- with .Values.ray.kuberay.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* envFrom of every Ray container (object-store credentials). */}}
{{- define "etrain.ray.envFrom" -}}
{{- if .Values.checkpoints.credentialsSecret }}
envFrom:
  - secretRef:
      name: {{ .Values.checkpoints.credentialsSecret }}
{{- end }}
{{- end }}

{{/* Volume mounts of every Ray container. */}}
{{- define "etrain.ray.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- if include "etrain.checkpointVolume" . }}
- name: checkpoints
  mountPath: {{ .Values.checkpoints.mountPath }}
{{- end }}
{{- end }}

{{/* Volumes of every Ray pod. Call with (dict "root" $ "shmSize" <size>). */}}
{{- define "etrain.ray.volumes" -}}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .shmSize }}
    sizeLimit: {{ . }}
    {{- end }}
{{- if include "etrain.checkpointVolume" .root }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "etrain.checkpointClaimName" .root }}
{{- end }}
{{- end }}

{{/* Pod-level securityContext of the Ray pods. */}}
{{- define "etrain.ray.podSecurityContext" -}}
{{- toYaml .Values.ray.kuberay.podSecurityContext }}
{{- end }}

{{/* The scrape token is served when metrics or the ServiceMonitor are on. */}}
{{- define "etrain.metricsEnabled" -}}
{{- if or .Values.metrics.enabled .Values.metrics.serviceMonitor.enabled }}true{{ end }}
{{- end }}
{{- define "etrain.metricsTokenSecretName" -}}
{{- default (printf "%s-metrics-token" (include "etrain.fullname" .)) .Values.metrics.existingSecret }}
{{- end }}
{{- define "etrain.metricsTokenSecretKey" -}}
{{- if .Values.metrics.existingSecret }}{{ .Values.metrics.existingSecretKey }}{{ else }}metrics-token{{ end }}
{{- end }}
