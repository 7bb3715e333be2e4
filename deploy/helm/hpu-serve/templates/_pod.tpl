{{/*
The pod template shared by the Deployment and both templates of the LeaderWorkerSet.
Called with (dict "root" $ "role" ROLE):
  server: the Deployment's pod, the image entrypoint (`hpu-serve serve`) with the chart's flags;
  leader: starts the Ray head, waits for the group's other pods to join it, then execs the same
          `hpu-serve serve` with --distributed-executor-backend ray; the only pod serving HTTP;
  worker: joins the leader's Ray cluster and blocks; Ray starts this pod's ranks in it.
Every role gets the same image, resources, environment (the ranks on a worker read the
PT_HPU_* / VLLM_* knobs from it), volumes and scheduling.
*/}}
{{- define "hpu-serve.podTemplate" -}}
{{- $r := .root -}}
{{- $role := .role -}}
{{- $v := $r.Values -}}
{{- $e := $v.engine -}}
{{- $model := include "hpu-serve.modelArg" $r -}}
{{- $backend := include "hpu-serve.executorBackend" $r -}}
{{- $serves := ne $role "worker" -}}
{{- $shm := or (eq $v.device "hpu") (gt (int $v.tensorParallelSize) 1) $v.multiHost.enabled -}}
{{- $scheme := ternary ", scheme: HTTPS" "" (ne $v.tls.secretName "") -}}
metadata:
  labels:
    {{- include "hpu-serve.selectorLabels" $r | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ $v.bucketing.fromFile | sha256sum | trunc 16 }}
    {{- if and $serves $v.metrics.podAnnotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $v.service.port | quote }}
    prometheus.io/path: /metrics
    {{- if $v.tls.secretName }}
    prometheus.io/scheme: https
    {{- end }}
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "hpu-serve.serviceAccountName" $r }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  containers:
    - name: hpu-serve
      image: "{{ $v.image.repository }}:{{ $v.image.tag | default $r.Chart.AppVersion }}"
      imagePullPolicy: {{ $v.image.pullPolicy }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      {{- if eq $role "leader" }}
      # the Ray head; once all multiHost.size Ray nodes are up, the server (the same flags as
      # the Deployment's, from args) drives the ranks through Ray
      command:
        - /bin/sh
        - -c
        - |
          set -e
          ray start --head --port=6379 --disable-usage-stats{{ range $v.multiHost.rayStartArgs }} {{ . | squote }}{{ end }}
          python -c '
          import sys, time, ray
          want, timeout = int(sys.argv[1]), float(sys.argv[2])
          ray.init(address="auto", logging_level="ERROR")
          deadline = time.monotonic() + timeout
          while (alive := sum(1 for n in ray.nodes() if n["Alive"])) < want:
              if time.monotonic() > deadline:
                  sys.exit(f"only {alive} of {want} Ray nodes joined within {timeout:.0f} s")
              print(f"Ray cluster: {alive} of {want} nodes", flush=True)
              time.sleep(5)
          ' {{ $v.multiHost.size }} {{ $v.multiHost.workersJoinTimeout }}
          exec hpu-serve serve --host 0.0.0.0 "$@"
        - hpu-serve-leader
      {{- else if eq $role "worker" }}
      # $(LWS_LEADER_ADDRESS) is set by the LeaderWorkerSet controller and expanded by the kubelet.
      command:
        - /bin/sh
        - -c
        - |
          set -e
          python -c '
          import socket, sys, time
          while True:
              try:
                  socket.create_connection((sys.argv[1], 6379), timeout=5).close()
                  break
              except OSError as e:
                  print(f"waiting for the Ray head at {sys.argv[1]}:6379: {e}", flush=True)
                  time.sleep(5)
          ' "$(LWS_LEADER_ADDRESS)"
          exec ray start --address=$(LWS_LEADER_ADDRESS):6379 --block --disable-usage-stats{{ range $v.multiHost.rayStartArgs }} {{ . | squote }}{{ end }}
      {{- end }}
      {{- if $serves }}
      {{- if eq $role "server" }}
      # the image's entrypoint is `hpu-serve serve --host 0.0.0.0 --port 8000`
      {{- end }}
      args:
        {{- if $model }}
        - {{ $model | quote }}
        {{- end }}
        - --port
        - {{ $v.service.port | quote }}
        - --device
        - {{ $v.device | quote }}
        - --tensor-parallel-size
        - {{ $v.tensorParallelSize | int | quote }}
        {{- with $backend }}
        - --distributed-executor-backend
        - {{ . | quote }}
        {{- end }}
        - --dtype
        - {{ $e.dtype | quote }}
        - --max-num-seqs
        - {{ $e.maxNumSeqs | quote }}
        - --block-size
        - {{ $e.blockSize | quote }}
        - --gpu-memory-utilization
        - {{ $e.gpuMemoryUtilization | quote }}
        - --execution-mode
        - {{ $e.executionMode | quote }}
        - --max-waiting-requests
        - {{ $e.maxWaitingRequests | quote }}
        - --shutdown-timeout
        - {{ $e.shutdownTimeout | quote }}
        - --log-format
        - {{ $v.logFormat | quote }}
        {{- if not (kindIs "invalid" $e.maxModelLen) }}
        - --max-model-len
        - {{ $e.maxModelLen | int | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $e.maxNumBatchedTokens) }}
        - --max-num-batched-tokens
        - {{ $e.maxNumBatchedTokens | int | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $e.numGpuBlocksOverride) }}
        - --num-gpu-blocks-override
        - {{ $e.numGpuBlocksOverride | int | quote }}
        {{- end }}
        {{- with $v.model.servedModelName }}
        - --served-model-name
        - {{ . | quote }}
        {{- end }}
        {{- if $e.enforceEager }}
        - --enforce-eager
        {{- end }}
        {{- if $e.disableAccessLog }}
        - --disable-uvicorn-access-log
        {{- end }}
        {{- with $v.tracing.otlpEndpoint }}
        - --otlp-traces-endpoint
        - {{ . | quote }}
        {{- end }}
        {{- with $v.tls.secretName }}
        - --ssl-certfile
        - /etc/hpu-serve-tls/{{ $v.tls.certKey }}
        - --ssl-keyfile
        - /etc/hpu-serve-tls/{{ $v.tls.keyKey }}
        {{- with $v.tls.caSecretKey }}
        - --ssl-ca-certs
        - /etc/hpu-serve-tls/{{ . }}
        {{- end }}
        {{- if $v.tls.clientCertReqs }}
        - --ssl-cert-reqs
        - {{ $v.tls.clientCertReqs | quote }}
        {{- end }}
        {{- end }}
        {{- range $e.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ $v.service.port }}
          protocol: TCP
        {{- if eq $role "leader" }}
        - name: ray-gcs
          containerPort: 6379
          protocol: TCP
        {{- end }}
      {{- end }}
      env:
        {{- include "hpu-serve.knobEnv" $r | nindent 8 }}
        {{- if eq $v.device "hpu" }}
        - name: HABANA_VISIBLE_DEVICES
          value: all
        - name: OMPI_MCA_btl_vader_single_copy_mechanism
          value: none
        {{- if and (or (gt (int $v.tensorParallelSize) 1) $v.multiHost.enabled) $v.warmup.lazyMode }}
        # collectives inside HPU graphs (lazy mode) need this (vLLM's Gaudi guide)
        - name: PT_HPU_ENABLE_LAZY_COLLECTIVES
          value: "true"
        {{- end }}
        {{- else }}
        - name: VLLM_CPU_KVCACHE_SPACE
          value: {{ $v.cpuKvCacheSpace | quote }}
        {{- end }}
        {{- if and $serves (or $v.apiKey.existingSecret $v.apiKey.value) }}
        - name: VLLM_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ include "hpu-serve.apiKeySecret" $r }}
              key: {{ $v.apiKey.secretKey }}
        {{- end }}
        {{- if and $serves $v.tracing.otlpEndpoint }}
        - name: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
          value: {{ $v.tracing.protocol | quote }}
        - name: OTEL_EXPORTER_OTLP_TRACES_INSECURE
          value: {{ $v.tracing.insecure | quote }}
        - name: OTEL_SERVICE_NAME
          value: {{ $v.tracing.serviceName | default (include "hpu-serve.fullname" $r) | quote }}
        {{- end }}
        {{- with $v.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $serves }}
      startupProbe:
        httpGet: {path: /health, port: http{{ $scheme }}}
        periodSeconds: {{ $v.startupProbe.periodSeconds }}
        failureThreshold: {{ $v.startupProbe.failureThreshold }}
        timeoutSeconds: {{ $v.startupProbe.timeoutSeconds }}
      readinessProbe:
        httpGet: {path: /health, port: http{{ $scheme }}}
        periodSeconds: {{ $v.readinessProbe.periodSeconds }}
        failureThreshold: {{ $v.readinessProbe.failureThreshold }}
        timeoutSeconds: {{ $v.readinessProbe.timeoutSeconds }}
      livenessProbe:
        httpGet: {path: /health, port: http{{ $scheme }}}
        periodSeconds: {{ $v.livenessProbe.periodSeconds }}
        failureThreshold: {{ $v.livenessProbe.failureThreshold }}
        timeoutSeconds: {{ $v.livenessProbe.timeoutSeconds }}
      {{- end }}
      resources:
        {{- $res := deepCopy ($v.resources | default dict) }}
        {{- if eq $v.device "hpu" }}
        {{- $cards := dict "habana.ai/gaudi" (int (include "hpu-serve.cards" $r)) }}
        {{- $_ := set $res "limits" (mergeOverwrite (get $res "limits" | default dict) $cards) }}
        {{- $_ := set $res "requests" (mergeOverwrite (get $res "requests" | default dict) $cards) }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      volumeMounts:
        - {name: cache, mountPath: /cache}
        - {name: tmp, mountPath: /tmp}
        {{- if ne $v.model.source "image" }}
        - name: models
          mountPath: /models
          readOnly: true
          {{- if and (eq $v.model.source "pvc") $v.model.pvc.subPath }}
          subPath: {{ $v.model.pvc.subPath }}
          {{- end }}
        {{- end }}
        {{- if $v.bucketing.fromFile }}
        - {name: buckets, mountPath: /etc/hpu-serve, readOnly: true}
        {{- end }}
        {{- if and $serves $v.tls.secretName }}
        - {name: tls, mountPath: /etc/hpu-serve-tls, readOnly: true}
        {{- end }}
        {{- if $shm }}
        - {name: dshm, mountPath: /dev/shm}
        {{- end }}
  volumes:
    - name: cache
      {{- if eq $v.compileCache.type "pvc" }}
      persistentVolumeClaim:
        claimName: {{ $v.compileCache.claimName }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ $v.compileCache.sizeLimit }}
      {{- end }}
    - name: tmp
      emptyDir: {}
    {{- if eq $v.model.source "pvc" }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ $v.model.pvc.claimName }}
        readOnly: true
    {{- else if eq $v.model.source "hostPath" }}
    - name: models
      hostPath:
        path: {{ $v.model.hostPath.path }}
        type: {{ $v.model.hostPath.type }}
    {{- end }}
    {{- if $v.bucketing.fromFile }}
    - name: buckets
      configMap:
        name: {{ include "hpu-serve.fullname" $r }}-buckets
    {{- end }}
    {{- if and $serves $v.tls.secretName }}
    - name: tls
      secret:
        secretName: {{ $v.tls.secretName }}
    {{- end }}
    {{- if $shm }}
    # multi-process torch (the ranks, HCCL, Ray's object store) needs a real /dev/shm; the
    # runtime's default is 64 MiB. Memory-backed: it counts against the pod's memory.
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shmSize }}
    {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
