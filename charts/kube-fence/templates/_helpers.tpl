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
