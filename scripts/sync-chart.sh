#!/usr/bin/env bash
# Copies the kustomize files the Helm chart reads into deploy/helm/nodeagent/files, so the
# chart is whole without symlinks (Flux and other Git sources drop them: flux2#4088).
# deploy/ stays the source: edit there, run this, commit both. tests/test_chart_sync.py
# fails when a copy and its original differ.
#   scripts/sync-chart.sh           copy
#   scripts/sync-chart.sh --check   exit 1, naming each file that differs, copy nothing
set -euo pipefail
cd "$(dirname "$0")/.."
files=deploy/helm/nodeagent/files
# chart path under files/ <- path under deploy/
pairs=(
  base/daemonset.yaml                  base/daemonset.yaml
  base/serviceaccount.yaml             base/serviceaccount.yaml
  base/rbac.yaml                       base/rbac.yaml
  base/service.yaml                    base/service.yaml
  base/servicemonitor.yaml             base/servicemonitor.yaml
  base/prometheusrule.yaml             base/prometheusrule.yaml
  base/nodeagent-dashboard.json        base/nodeagent-dashboard.json
  openshift/scc.yaml                   overlays/openshift/scc.yaml
  openshift/scc-rbac.yaml              overlays/openshift/scc-rbac.yaml
  hold-openshift/scc-patch.yaml        components/peermem-hold-openshift/scc-patch.yaml
  npd/nodeagent-npd-check              npd/nodeagent-npd-check
  npd/nodeagent-monitor.json           npd/nodeagent-monitor.json
  npd/nodeagent-journal-monitor.json   npd/nodeagent-journal-monitor.json
)
check=false
[ "${1:-}" = --check ] && check=true
stale=0
for ((i = 0; i < ${#pairs[@]}; i += 2)); do
  copy=$files/${pairs[i]} original=deploy/${pairs[i + 1]}
  if $check; then
    if ! cmp -s "$original" "$copy"; then
      echo "$copy differs from $original: run scripts/sync-chart.sh" >&2
      stale=1
    fi
  else
    mkdir -p "$(dirname "$copy")"
    [ -L "$(dirname "$copy")" ] && { echo "$(dirname "$copy") is a symlink: remove it" >&2; exit 1; }
    install -m "$(stat -c %a "$original")" "$original" "$copy"
  fi
done
exit $stale
