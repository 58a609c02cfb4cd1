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

{{/* The policy path (policyPath.enabled): kube-fence's admission/policy_path.rs, verbatim (tests/chart.rs compares them). */}}
{{- define "kube-fence.policyPathCondition" -}}
request.operation == 'UPDATE' && (!has(request.subResource) || request.subResource == '') && object != null && oldObject != null && (has(oldObject.metadata.labels) && 'kubefence.io/lease' in oldObject.metadata.labels) && (has(object.metadata.labels) && 'kubefence.io/lease' in object.metadata.labels) && object.metadata.labels['kubefence.io/lease'] == oldObject.metadata.labels['kubefence.io/lease'] && !(has(oldObject.metadata.labels) && 'kubefence.io/writer' in oldObject.metadata.labels) && !(has(object.metadata.labels) && 'kubefence.io/writer' in object.metadata.labels) && (has(oldObject.metadata.annotations) && 'kubefence.io/token' in oldObject.metadata.annotations) && (has(object.metadata.annotations) && 'kubefence.io/token' in object.metadata.annotations) && (oldObject.metadata.annotations['kubefence.io/token'].matches('^(0|[1-9][0-9]{0,18})$') && (size(oldObject.metadata.annotations['kubefence.io/token']) < 19 || oldObject.metadata.annotations['kubefence.io/token'] <= '9223372036854775807')) && (object.metadata.annotations['kubefence.io/token'].matches('^(0|[1-9][0-9]{0,18})$') && (size(object.metadata.annotations['kubefence.io/token']) < 19 || object.metadata.annotations['kubefence.io/token'] <= '9223372036854775807')) && int(object.metadata.annotations['kubefence.io/token']) > int(oldObject.metadata.annotations['kubefence.io/token'])
{{- end -}}
{{- define "kube-fence.policyPathRule" -}}
variables.issued >= 0 && int(variables.presented) <= variables.issued
{{- end -}}
{{- define "kube-fence.policyPathMessage" -}}
'kubefence.io/policy-path TokenNotIssued ' + object.metadata.namespace + '/' + variables.lease + ' presented=' + variables.presented + ' issued=' + (variables.issued < 0 ? 'none' : string(variables.issued)) + ': token ' + variables.presented + ' is newer than the newest token of lease ' + object.metadata.namespace + '/' + variables.lease + ' the API server has seen issued (LeaseTokens kube-fence-tokens): it was never issued, or it was granted a moment ago and the cache has not seen it yet (retry)'
{{- end -}}
{{- define "kube-fence.policyPathVariable.lease" -}}
object.metadata.labels['kubefence.io/lease']
{{- end -}}
{{- define "kube-fence.policyPathVariable.presented" -}}
object.metadata.annotations['kubefence.io/token']
{{- end -}}
{{- define "kube-fence.policyPathVariable.issued" -}}
has(params.spec) && has(params.spec.tokens) && variables.lease in params.spec.tokens ? params.spec.tokens[variables.lease] : -1
{{- end -}}
