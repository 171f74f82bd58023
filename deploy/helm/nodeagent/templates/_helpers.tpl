{{/* The app's name (app.kubernetes.io/name, selectors): nameOverride, else the chart's. */}}
{{- define "nodeagent.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The objects' name, and the prefix of the others' (nodeagent-config...):
fullnameOverride, else the name. Not the release's: one node agent a cluster, and the
kustomize base's names (tests/test_helm.py compares the two). */}}
{{- define "nodeagent.fullname" -}}
{{- .Values.fullnameOverride | default (include "nodeagent.name" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{/* A base file's name (nodeagent, nodeagent-<suffix>) with the fullname in its place. */}}
{{- define "nodeagent.renamed" -}}
{{- if hasPrefix "nodeagent" .name -}}
{{- printf "%s%s" (include "nodeagent.fullname" .root) (trimPrefix "nodeagent" .name) -}}
{{- else -}}
{{- .name -}}
{{- end -}}
{{- end -}}

{{/* An image reference from {registry, repository, tag, digest}: the digest wins over the
tag; the tag defaults to .default (the chart's appVersion for the agent). */}}
{{- define "nodeagent.imageRef" -}}
{{- $i := .image -}}
{{- $ref := $i.repository -}}
{{- with $i.registry }}{{ $ref = printf "%s/%s" (trimSuffix "/" .) $ref }}{{ end -}}
{{- if $i.digest -}}
{{- printf "%s@%s" $ref $i.digest -}}
{{- else -}}
{{- $tag := $i.tag | default .default -}}
{{- if not $tag }}{{ fail (printf "chart: %s.tag or %s.digest must be set" .key .key) }}{{ end -}}
{{- printf "%s:%s" $ref $tag -}}
{{- end -}}
{{- end -}}

{{/* The labels every object gets: the base's (kustomize's `labels`) and Helm's. */}}
{{- define "nodeagent.labels" -}}
app.kubernetes.io/name: {{ include "nodeagent.name" . }}
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
{{- include "nodeagent.rename" (dict "root" $.root "obj" $obj) -}}
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
{{- $peermem := dict "enabled" $a.peermem.enabled "mofed" $a.peermem.mofed -}}
{{- if .Values.hold.enabled -}}{{- $_ := set $peermem "hold_loads" "fanotify" -}}{{- end -}}
{{- $_ := set $cfg "peermem" $peermem -}}
{{- $_ := set $cfg "storage" (dict "enabled" $a.storage.enabled) -}}
{{- $_ := set $cfg "sriov" (dict "enabled" $a.sriov.enabled "numvfs_owner" $a.sriov.numvfsOwner) -}}
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

{{/* nameOverride and fullnameOverride through a base object: its name, the names it refers
to (service account, config map, role, SCC) and its selectors' app.kubernetes.io/name. */}}
{{- define "nodeagent.rename" -}}
{{- $root := .root -}}
{{- $o := .obj -}}
{{- $name := include "nodeagent.name" $root -}}
{{- $_ := set $o.metadata "name" (include "nodeagent.renamed" (dict "root" $root "name" $o.metadata.name)) -}}
{{- with $o.spec -}}
{{- $selectors := list (.selector | default dict) ((.selector | default dict).matchLabels | default dict) -}}
{{- with .template -}}
{{- $selectors = append $selectors .metadata.labels -}}
{{- $pod := .spec -}}
{{- $_ := set $pod "serviceAccountName" (include "nodeagent.renamed" (dict "root" $root "name" $pod.serviceAccountName)) -}}
{{- range $vol := $pod.volumes -}}
{{- with $vol.configMap -}}
{{- $_ := set . "name" (include "nodeagent.renamed" (dict "root" $root "name" .name)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $labels := $selectors -}}
{{- if hasKey $labels "app.kubernetes.io/name" -}}{{- $_ := set $labels "app.kubernetes.io/name" $name -}}{{- end -}}
{{- end -}}
{{- range $group := (.groups | default list) -}}
{{- range $rule := $group.rules -}}
{{- $_ := set $rule "expr" (replace "job=\"nodeagent\"" (printf "job=%q" (include "nodeagent.fullname" $root)) $rule.expr) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with $o.roleRef -}}
{{- $_ := set . "name" (include "nodeagent.renamed" (dict "root" $root "name" .name)) -}}
{{- end -}}
{{- range $s := ($o.subjects | default list) -}}
{{- $_ := set $s "name" (include "nodeagent.renamed" (dict "root" $root "name" $s.name)) -}}
{{- end -}}
{{- range $rule := ($o.rules | default list) -}}
{{- with $rule.resourceNames -}}
{{- $names := list -}}
{{- range $n := . }}{{ $names = append $names (include "nodeagent.renamed" (dict "root" $root "name" $n)) }}{{ end -}}
{{- $_ := set $rule "resourceNames" $names -}}
{{- end -}}
{{- end -}}
{{- end -}}
