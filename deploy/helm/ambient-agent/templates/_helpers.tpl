{{/* Labels on every object (no release-specific ones: deploy/kubernetes/ is rendered from this chart). */}}
{{- define "ambient-agent.labels" -}}
app.kubernetes.io/name: ambient-agent
app.kubernetes.io/part-of: ambient-agent
{{- end }}

{{/* The agent's image reference. */}}
{{- define "ambient-agent.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The address ztunnel reaches the agent's TLS port (xDS, and the CA in embedded mode) on. */}}
{{- define "ambient-agent.nodeLocalAddress" -}}
https://$(HOST_IP):{{ .Values.ports.xdsTls }}
{{- end }}
