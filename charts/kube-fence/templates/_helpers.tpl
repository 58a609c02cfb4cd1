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
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The `helm test` objects' labels: never the Deployment's selector (the Service would send
reviews to the test Pod, and whoever lists kube-fence's Pods would find it). */}}
{{- define "kube-fence.testLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: kube-fence-selftest
app.kubernetes.io/instance: {{ printf "%s-selftest" .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The Pods' labels: the selector's, commonLabels, podLabels. */}}
{{- define "kube-fence.podLabels" -}}
{{ include "kube-fence.selectorLabels" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- with .Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kube-fence.selectorLabels" -}}
app.kubernetes.io/name: kube-fence
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* repository@digest when a digest is given (the tag is then ignored), else repository:tag. */}}
{{- define "kube-fence.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* The ValidatingWebhookConfiguration's name: one per release, cluster-scoped. */}}
{{- define "kube-fence.webhookConfiguration" -}}{{ include "kube-fence.fullname" . }}{{- end -}}
{{- define "kube-fence.serviceName" -}}{{ include "kube-fence.fullname" . }}-webhook{{- end -}}
