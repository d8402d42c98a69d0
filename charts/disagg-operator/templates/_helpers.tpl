{{/* Names. */}}
{{- define "disagg-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "disagg-operator.fullname" -}}
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

{{- define "disagg-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "disagg-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "disagg-operator.peeringName" -}}
{{- default (include "disagg-operator.fullname" .) .Values.peering.name }}
{{- end }}

{{/* Labels. */}}
{{- define "disagg-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "disagg-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "disagg-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: disagg
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The operator image: repository@digest, else repository:tag (default appVersion). */}}
{{- define "disagg-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Scope. "clusterWide": the operator watches every namespace (no watch.namespaces); kopf then
uses a ClusterKopfPeering. "rbacClusterWide": the workload rules are bound cluster-wide, also
when a watched namespace is a glob (a RoleBinding needs a namespace that exists).
Both print "true" or nothing.
*/}}
{{- define "disagg-operator.clusterWide" -}}
{{- if not .Values.watch.namespaces }}true{{ end }}
{{- end }}

{{- define "disagg-operator.hasGlobs" -}}
{{- range .Values.watch.namespaces }}{{ if or (contains "*" .) (contains "?" .) }}true{{ end }}{{ end }}
{{- end }}

{{- define "disagg-operator.rbacClusterWide" -}}
{{- if or (include "disagg-operator.clusterWide" .) (include "disagg-operator.hasGlobs" .) }}true{{ end }}
{{- end }}

{{/* The watched namespaces that are names, not globs (RoleBindings, KopfPeerings). */}}
{{- define "disagg-operator.exactNamespaces" -}}
{{- range .Values.watch.namespaces }}
{{- if not (or (contains "*" .) (contains "?" .)) }}
- {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* `disagg operator` arguments (see `disagg operator --help`). */}}
{{- define "disagg-operator.args" -}}
{{- if include "disagg-operator.clusterWide" . }}
- --all-namespaces
{{- else }}
{{- range .Values.watch.namespaces }}
- --namespace={{ . }}
{{- end }}
{{- end }}
- --liveness-port={{ .Values.liveness.port }}
- --liveness-stall={{ .Values.liveness.stallSeconds }}
- --metrics-port={{ ternary .Values.metrics.port 0 .Values.metrics.enabled }}
{{- if .Values.peering.enabled }}
- --peering={{ include "disagg-operator.peeringName" . }}
{{- else }}
- --standalone
{{- end }}
- --cluster-domain={{ .Values.operator.clusterDomain }}
- --gpu-mode={{ .Values.operator.gpuMode }}
- --dra-api-version={{ .Values.operator.draApiVersion }}
- --progress-deadline={{ .Values.operator.progressDeadlineSeconds }}
- --metrics-namespace={{ .Release.Namespace }}
{{- range .Values.networkPolicy.metricsNamespaces }}
- --metrics-namespace={{ . }}
{{- end }}
- --autoscale-interval={{ .Values.operator.autoscaleIntervalSeconds }}
{{- if .Values.monitoring.podMonitors }}
- --pod-monitors
{{- end }}
- --log-level={{ .Values.logLevel }}
{{- end }}

{{/* Checks the schema cannot express. */}}
{{- define "disagg-operator.checks" -}}
{{- if eq (int .Values.liveness.port) (int .Values.metrics.port) }}
{{- fail (printf "liveness.port and metrics.port must differ (both are %v)" .Values.liveness.port) }}
{{- end }}
{{- end }}

{{/* The subjects of every binding: the operator's ServiceAccount. */}}
{{- define "disagg-operator.subjects" -}}
- kind: ServiceAccount
  name: {{ include "disagg-operator.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}

{{/* The rules of what the operator does where it works (a ClusterRole, or a Role per
namespace with rbac.namespaced). */}}
{{- define "disagg-operator.workloadRules" -}}
  # The pipelines: watched, annotated by kopf (handler progress), their status written.
  - apiGroups: ["disagg.dev"]
    resources: ["disaggregatedpipelines"]
    verbs: ["get", "list", "watch", "patch"]
  - apiGroups: ["disagg.dev"]
    resources: ["disaggregatedpipelines/status"]
    verbs: ["patch"]
  # Their children: server-side applied (a PATCH that the API server also authorizes as
  # `create` when the object is absent), listed by label (StatefulSets and the gateway's
  # Deployment: watched, the operator's cache), read when not found, pruned when the plan
  # drops them.
  - apiGroups: ["apps"]
    resources: ["statefulsets"]
    verbs: ["get", "list", "watch", "create", "patch", "delete"]
  - apiGroups: ["apps"]
    resources: ["deployments"]
    verbs: ["get", "list", "watch", "create", "patch", "delete"]
  - apiGroups: [""]
    resources: ["services", "configmaps"]
    verbs: ["get", "list", "create", "patch", "delete"]
  - apiGroups: ["resource.k8s.io"]
    resources: ["resourceclaimtemplates"]
    verbs: ["get", "list", "create", "patch", "delete"]
  # The pipelines' NetworkPolicies; watched (by label) so that a deleted one comes back.
  - apiGroups: ["networking.k8s.io"]
    resources: ["networkpolicies"]
    verbs: ["get", "list", "watch", "create", "patch", "delete"]
  # The peer key Secrets: read and created, never changed; watched (by label: the operator
  # lists no one else's) so that deleting one rotates the key.
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["get", "list", "watch", "create"]
  # The autoscaler watches the pipelines' pods (by label) to scrape their pool occupancy;
  # a role of groups (roles[].nodes) restarts a group by deleting its other members' pods.
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["list", "watch", "delete"]
  # Events about the pipelines.
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["create"]
  # The pipelines' PodMonitors (where the Prometheus Operator's CRDs are installed and a
  # pipeline, or monitoring.podMonitors, asks for one): applied, listed, pruned. Whether
  # they are served is read from API discovery, which needs no rule.
  - apiGroups: ["monitoring.coreos.com"]
    resources: ["podmonitors"]
    verbs: ["get", "list", "create", "patch", "delete"]
  {{- if and .Values.peering.enabled (not (include "disagg-operator.clusterWide" .)) }}
  # Peering in each watched namespace (kopf writes its liveness into the object; into its
  # status subresource where the CRD has one).
  - apiGroups: ["kopf.dev"]
    resources: ["kopfpeerings"]
    verbs: ["list", "watch", "patch"]
  - apiGroups: ["kopf.dev"]
    resources: ["kopfpeerings/status"]
    verbs: ["patch"]
  {{- end }}
{{- end }}
