{{- define "kube-fence.name" -}}kube-fence{{- end -}}

{{- define "kube-fence.fullname" -}}
{{- if contains "kube-fence" .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-kube-fence" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "kube-fence.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "kube-fence.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kube-fence.selectorLabels" -}}
app.kubernetes.io/name: kube-fence
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kube-fence.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The ValidatingWebhookConfiguration's name: one per release, cluster-scoped. */}}
{{- define "kube-fence.webhookConfiguration" -}}{{ include "kube-fence.fullname" . }}{{- end -}}
{{- define "kube-fence.serviceName" -}}{{ include "kube-fence.fullname" . }}-webhook{{- end -}}

{{/* The webhook's match condition: kube-fence's registration.rs guard_condition(), verbatim (tests/chart.rs compares them). */}}
{{- define "kube-fence.guardCondition" -}}
!has(request.subResource) || request.subResource == '' || object == null || oldObject == null || (has(object.metadata.labels) && 'kubefence.io/lease' in object.metadata.labels) != (has(oldObject.metadata.labels) && 'kubefence.io/lease' in oldObject.metadata.labels) || ((has(object.metadata.labels) && 'kubefence.io/lease' in object.metadata.labels) && object.metadata.labels['kubefence.io/lease'] != oldObject.metadata.labels['kubefence.io/lease']) || (has(object.metadata.annotations) && 'kubefence.io/token' in object.metadata.annotations) != (has(oldObject.metadata.annotations) && 'kubefence.io/token' in oldObject.metadata.annotations) || ((has(object.metadata.annotations) && 'kubefence.io/token' in object.metadata.annotations) && object.metadata.annotations['kubefence.io/token'] != oldObject.metadata.annotations['kubefence.io/token']) || (has(oldObject.metadata.labels) && 'kubefence.io/writer' in oldObject.metadata.labels) || (has(object.metadata.labels) && 'kubefence.io/writer' in object.metadata.labels)
{{- end -}}

{{/* Namespaces fenced (webhook and lease-status policy alike). */}}
{{- define "kube-fence.namespaceSelector" -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values:
      {{- range .Values.webhook.excludedNamespaces }}
      - {{ . }}
      {{- end }}
      - {{ .Release.Namespace }}
  {{- with .Values.webhook.onlyNamespaces }}
  - key: kubernetes.io/metadata.name
    operator: In
    values: {{- toYaml . | nindent 6 }}
  {{- end }}
{{- end -}}
