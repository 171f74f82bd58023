{{/* The labels every object gets: the base's (kustomize's `labels`) and Helm's. */}}
{{- define "nodeagent.labels" -}}
app.kubernetes.io/name: nodeagent
app.kubernetes.io/part-of: nodeagent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The documents of a base file (files/ holds copies of deploy/'s: scripts/sync-chart.sh), as {"items": [...]}, each
with the release's namespace (cluster-scoped kinds excepted; a binding's subjects
too) and the labels. */}}
{{- define "nodeagent.objects" -}}
{{- $text := .root.Files.Get (printf "files/%s" .file) -}}
{{- if not $text -}}
{{- fail (printf "chart: files/%s is missing or empty (run scripts/sync-chart.sh)" .file) -}}
{{- end -}}
{{- $out := list -}}
{{- range $doc := splitList "\n---" $text -}}
{{- $obj := $doc | fromYaml -}}
{{- if $obj.kind -}}
{{- $meta := $obj.metadata -}}
{{- $_ := set $meta "labels" (merge (include "nodeagent.labels" $.root | fromYaml) ($meta.labels | default dict)) -}}
{{- if not (has $obj.kind (list "ClusterRole" "ClusterRoleBinding" "SecurityContextConstraints")) -}}
{{- $_ := set $meta "namespace" $.root.Release.Namespace -}}
{{- end -}}
{{- range $s := ($obj.subjects | default list) -}}
{{- $_ := set $s "namespace" $.root.Release.Namespace -}}
{{- end -}}
{{- $out = append $out $obj -}}
{{- end -}}
{{- end -}}
{{- dict "items" $out | toJson -}}
{{- end -}}

{{/* The one document of a base file, as a dict. */}}
{{- define "nodeagent.object" -}}
{{- $items := (include "nodeagent.objects" . | fromJson).items -}}
{{- if ne (len $items) 1 -}}{{- fail (printf "chart: files/%s holds %d objects, not 1" .file (len $items)) -}}{{- end -}}
{{- first $items | toJson -}}
{{- end -}}

{{/* agent.toml's keys, from the values; agent.extraConfig merged over them. */}}
{{- define "nodeagent.config" -}}
{{- $a := .Values.agent -}}
{{- $resync := $a.resyncSeconds -}}
{{- if eq (float64 (int64 $resync)) (float64 $resync) -}}{{- $resync = int64 $resync -}}{{- end -}}
{{- $cfg := dict "mode" $a.mode "resync_seconds" $resync -}}
{{- if ne (int .Values.metrics.port) 9808 -}}
{{- $_ := set $cfg "metrics_address" (printf "127.0.0.1:%d" (int .Values.metrics.port)) -}}
{{- end -}}
{{- $peermem := dict "mofed" $a.peermem.mofed -}}
{{- if .Values.hold.enabled -}}{{- $_ := set $peermem "hold_loads" "fanotify" -}}{{- end -}}
{{- $_ := set $cfg "peermem" $peermem -}}
{{- $_ := set $cfg "sriov" (dict "numvfs_owner" $a.sriov.numvfsOwner) -}}
{{- $_ := set $cfg "labels" (dict "nfd" .Values.labels.nfd) -}}
{{- $_ := set $cfg "npd" (dict "enabled" .Values.npd.enabled) -}}
{{- $extra := deepCopy ($a.extraConfig | default dict) -}}
{{- $_ := include "nodeagent.wholeNumbers" $extra -}}
{{- $cfg = mustMergeOverwrite $cfg $extra -}}
{{- toToml $cfg -}}
{{- end -}}

{{/* "true" when the monitoring objects may render: monitoring.apiAvailable true, or auto
and the Prometheus Operator's API served (helm install and upgrade ask the cluster; helm
template knows only what --api-versions says). Without it, a ServiceMonitor fails the
install on its kind. */}}
{{- define "nodeagent.monitoringApi" -}}
{{- $available := toString .Values.monitoring.apiAvailable -}}
{{- if eq $available "auto" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- else if eq $available "true" -}}true
{{- end -}}
{{- end -}}

{{/* The labels of a monitoring object: the chart's, then the user's additionalLabels
(kube-prometheus-stack's selectors want release: <its release>). */}}
{{- define "nodeagent.withLabels" -}}
{{- $_ := set .obj.metadata "labels" (merge .obj.metadata.labels (.labels | default dict)) -}}
{{- end -}}

{{/* Whole numbers in a map (and the maps in it) made integers, in place: Helm reads values'
numbers as floats, and toToml would write 4 as 4.0, which the agent's whole-number keys
(sriov.parallel, timeline_keep) refuse. */}}
{{- define "nodeagent.wholeNumbers" -}}
{{- range $key, $value := . -}}
{{- if kindIs "map" $value -}}
{{- $_ := include "nodeagent.wholeNumbers" $value -}}
{{- else if and (kindIs "float64" $value) (eq (float64 (int64 $value)) $value) -}}
{{- $_ := set $ $key (int64 $value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
