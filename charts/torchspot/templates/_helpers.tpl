{{/*
Naming and labels, shared by every template.
*/}}

{{/* The chart's name (overridable). Truncated to 63 characters: Kubernetes names and label values are limited to that. */}}
{{- define "torchspot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's base name for the objects it creates: the release name when it already
contains the chart's name (so `helm install torchspot` gives `torchspot`, not
`torchspot-torchspot`), else `<release>-<chart>`. 63 characters at most, as above.
*/}}
{{- define "torchspot.fullname" -}}
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

{{/* Labels every object of the release carries. */}}
{{- define "torchspot.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "torchspot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The operator pod's labels that its Deployment selects on (immutable once installed: keep them few). */}}
{{- define "torchspot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "torchspot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator's ServiceAccount: the chart's own, or one the user brings. */}}
{{- define "torchspot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "torchspot.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository, and tag (default: the chart's appVersion) or digest. */}}
{{- define "torchspot.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}
