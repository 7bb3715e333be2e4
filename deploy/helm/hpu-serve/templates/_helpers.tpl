{{- define "hpu-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hpu-serve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hpu-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hpu-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hpu-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "hpu-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "hpu-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "hpu-serve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "hpu-serve.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "hpu-serve.fullname" .)) .Values.apiKey.existingSecret -}}
{{- end -}}

{{/* The model argument of `hpu-serve serve`: empty = the embedded default model. */}}
{{- define "hpu-serve.modelArg" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "image" -}}
{{- $m.path -}}
{{- else if $m.path -}}
{{- printf "/models/%s" (trimPrefix "/" $m.path) -}}
{{- else -}}
/models
{{- end -}}
{{- end -}}

{{/* VLLM_* environment: every warmup / graph-memory / bucketing knob that has a value. */}}
{{- define "hpu-serve.knobEnv" -}}
{{- $w := .Values.warmup -}}
- name: VLLM_SKIP_WARMUP
  value: {{ $w.skip | quote }}
- name: VLLM_GRAPH_RESERVED_MEM
  value: {{ $w.graphReservedMem | quote }}
- name: VLLM_GRAPH_PROMPT_RATIO
  value: {{ $w.graphPromptRatio | quote }}
- name: VLLM_GRAPH_PROMPT_STRATEGY
  value: {{ $w.promptStrategy | quote }}
- name: VLLM_GRAPH_DECODE_STRATEGY
  value: {{ $w.decodeStrategy | quote }}
- name: PT_HPU_LAZY_MODE
  value: {{ ternary "1" "0" $w.lazyMode | quote }}
{{- $b := .Values.bucketing }}
- name: VLLM_ENABLE_BUCKETING
  value: {{ $b.enabled | quote }}
- name: VLLM_BUCKETING_STRATEGY
  value: {{ $b.strategy | quote }}
{{- range $phase := list "prompt" "decode" }}
{{- range $dim, $r := index $b $phase }}
{{- range $edge := list "min" "step" "max" }}
{{- $v := index $r $edge }}
{{- if not (kindIs "invalid" $v) }}
- name: {{ printf "VLLM_%s_%s_BUCKET_%s" (upper $phase) (upper $dim) (upper $edge) }}
  value: {{ $v | int | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if $b.fromFile }}
- name: VLLM_BUCKETING_FROM_FILE
  value: /etc/hpu-serve/buckets.txt
{{- end }}
{{- end -}}
