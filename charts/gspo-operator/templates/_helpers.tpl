{{- define "gspo-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gspo-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gspo-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gspo-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gspo-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "gspo-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "gspo-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gspo-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gspo-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
The namespaces a namespaced install watches, as a JSON list (read it with fromJsonArray): the
release namespace, then watchNamespaces, each once. The Deployment's --namespace args and
the Roles in templates/rbac.yaml both come from here, so they cannot disagree.
*/}}
{{- define "gspo-operator.watchNamespaces" -}}
{{- prepend .Values.watchNamespaces .Release.Namespace | uniq | toJson -}}
{{- end -}}
