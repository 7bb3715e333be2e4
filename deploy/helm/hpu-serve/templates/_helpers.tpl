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

{{/* Ranks per pod: every rank on one host, or the same share on each pod of a LeaderWorkerSet group. */}}
{{- define "hpu-serve.ranksPerPod" -}}
{{- $tp := int .Values.tensorParallelSize -}}
{{- if .Values.multiHost.enabled -}}
{{- div $tp (int .Values.multiHost.size) -}}
{{- else -}}
{{- $tp -}}
{{- end -}}
{{- end -}}

{{/* Gaudi cards per pod. Given once as gaudi.cards or resources.{limits,requests}["habana.ai/gaudi"]
     (each that is given must agree); by default one card per rank of the pod. */}}
{{- define "hpu-serve.cards" -}}
{{- $given := dict -}}
{{- if not (kindIs "invalid" .Values.gaudi.cards) -}}
{{- $_ := set $given "gaudi.cards" (int .Values.gaudi.cards) -}}
{{- end -}}
{{- $res := .Values.resources | default dict -}}
{{- range $kind := list "limits" "requests" -}}
{{- $v := index (get $res $kind | default dict) "habana.ai/gaudi" -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $_ := set $given (printf "resources.%s[\"habana.ai/gaudi\"]" $kind) (int $v) -}}
{{- end -}}
{{- end -}}
{{- $counts := values $given | uniq -}}
{{- if gt (len $counts) 1 -}}
{{- fail (printf "the Gaudi card count is given differently in %s: give it once (gaudi.cards), requests and limits must be equal" (toJson $given)) -}}
{{- end -}}
{{- if $counts -}}
{{- first $counts -}}
{{- else -}}
{{- include "hpu-serve.ranksPerPod" . -}}
{{- end -}}
{{- end -}}

{{/* --distributed-executor-backend: ray across pods, else the value (empty = the daemon's mp). */}}
{{- define "hpu-serve.executorBackend" -}}
{{- if .Values.multiHost.enabled -}}
ray
{{- else -}}
{{- .Values.distributedExecutorBackend -}}
{{- end -}}
{{- end -}}

{{/* Settings that each pass the schema but do not work together: fail at install time. */}}
{{- define "hpu-serve.validate" -}}
{{- $tp := int .Values.tensorParallelSize -}}
{{- $mh := .Values.multiHost -}}
{{- if $mh.enabled -}}
{{- $size := int $mh.size -}}
{{- if eq .Values.distributedExecutorBackend "mp" -}}
{{- fail "multiHost.enabled runs the ranks on several pods through Ray: distributedExecutorBackend must be \"ray\" or empty, not \"mp\" (mp starts every rank on one host)" -}}
{{- end -}}
{{- if or (lt $tp $size) (ne (mod $tp $size) 0) -}}
{{- fail (printf "multiHost.size=%d pods need tensorParallelSize to be a multiple of %d (every pod runs the same number of ranks); got tensorParallelSize=%d" $size $size $tp) -}}
{{- end -}}
{{- if .Values.autoscaling.enabled -}}
{{- fail "autoscaling.enabled scales a Deployment; with multiHost.enabled scale whole groups with replicaCount instead" -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.device "hpu" -}}
{{- $cards := int (include "hpu-serve.cards" .) -}}
{{- $ranks := int (include "hpu-serve.ranksPerPod" .) -}}
{{- if and $mh.enabled (ne $cards $ranks) -}}
{{- fail (printf "tensorParallelSize=%d over multiHost.size=%d pods is %d ranks per pod, one Gaudi card each: each pod must request %d cards (gaudi.cards), not %d" $tp (int $mh.size) $ranks $ranks $cards) -}}
{{- end -}}
{{- if lt $cards $ranks -}}
{{- fail (printf "tensorParallelSize=%d needs %d Gaudi cards (one per rank) but the pod requests %d (gaudi.cards)" $tp $ranks $cards) -}}
{{- end -}}
{{- end -}}
{{- end -}}
