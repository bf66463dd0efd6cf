{{- define "mooncake-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mooncake-operator.selectorLabels" -}}
app.kubernetes.io/name: mooncake-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mooncake-operator.labels" -}}
{{ include "mooncake-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: mooncake
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "mooncake-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mooncake-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The RBAC rules, shared by the ClusterRole and the per-namespace Roles. */}}
{{- define "mooncake-operator.rules" -}}
# MooncakeClusters: watched by kopf, status and annotations patched.
- apiGroups: ["mooncake.io"]
  resources: ["mooncakeclusters"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["mooncake.io"]
  resources: ["mooncakeclusters/status"]
  verbs: ["get", "patch", "update"]
# Scalers: applied (server-side apply creates them), watched, scaled, status written.
- apiGroups: ["mooncake.io"]
  resources: ["mooncakerolescalers"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
- apiGroups: ["mooncake.io"]
  resources: ["mooncakerolescalers/status", "mooncakerolescalers/scale"]
  verbs: ["get", "patch", "update"]
# Children, applied with server-side apply (create + patch) and read back for status.
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
# The generated cluster token: checked for and created once; never listed or watched.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# Pod status: readiness, crash loops and the rdma-probe records.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
