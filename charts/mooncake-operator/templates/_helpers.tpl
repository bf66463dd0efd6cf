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

{{/* The RBAC rules, shared by the ClusterRole and the per-namespace Roles: exactly the calls
the operator makes (kopf's watches and merge patches, server-side apply = create + patch, reads
for status). Nothing is ever replaced with PUT, so no rule grants `update`. */}}
{{- define "mooncake-operator.rules" -}}
# MooncakeClusters: watched by kopf, status and annotations patched.
- apiGroups: ["mooncake.io"]
  resources: ["mooncakeclusters"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["mooncake.io"]
  resources: ["mooncakeclusters/status"]
  verbs: ["get", "patch"]
# Scalers: applied (server-side apply creates them), watched, scaled, status written.
- apiGroups: ["mooncake.io"]
  resources: ["mooncakerolescalers"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["mooncake.io"]
  resources: ["mooncakerolescalers/status", "mooncakerolescalers/scale"]
  verbs: ["get", "patch"]
# Children, applied with server-side apply (create + patch) and read back for status.
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch"]
# spec.gateway's route to the Conductor (Gateway API; unused where its CRDs are absent).
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The generated cluster token: created once (an existing one answers 409, which is fine). The
# operator never reads a Secret: pods get the token through secretKeyRef.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# Pod status: readiness, crash loops and the rdma-probe records. delete: a prefill pipeline
# group restarts together (a stage that restarted alone gets its peers deleted; the
# StatefulSet starts them again). Nothing else is ever deleted by the operator.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* The pod securityContext: never root, RuntimeDefault seccomp; a fixed UID/GID only where
the values set one (OpenShift's restricted SCC assigns its own and refuses a fixed one). */}}
{{- define "mooncake-operator.podSecurityContext" -}}
runAsNonRoot: true
{{- with .Values.podSecurityContext }}
{{- if hasKey . "runAsUser" }}
runAsUser: {{ .runAsUser }}
{{- end }}
{{- if hasKey . "runAsGroup" }}
runAsGroup: {{ .runAsGroup }}
{{- end }}
{{- if hasKey . "fsGroup" }}
fsGroup: {{ .fsGroup }}
{{- end }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}
