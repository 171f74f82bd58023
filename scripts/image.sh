#!/usr/bin/env bash
# Build the agent's image with buildah (as the tests do) for the platforms this machine can,
# push it, print the digest and the helm line that pins it. (The SBOM is not done yet.)
#   scripts/image.sh [--push REGISTRY/REPO] [--platform linux/amd64,linux/arm64] [--dry-run]
# --dry-run prints each command (one argv per line) instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."

push=""
platforms="linux/amd64"
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push="${2-}"; shift 2 || { echo "image.sh: --push needs REGISTRY/REPO" >&2; exit 2; } ;;
    --platform) platforms="${2-}"; shift 2 || { echo "image.sh: --platform needs a list" >&2; exit 2; } ;;
    --dry-run) dry_run=1; shift ;;
    *) echo "image.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done

# REGISTRY/REPO: a host (with an optional port) and lower-case path components, no tag.
repo_re='^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+$'
if [ -n "$push" ] && ! [[ "$push" =~ $repo_re ]]; then
  echo "image.sh: --push wants REGISTRY/REPO (lower case, no tag), not: $push" >&2
  exit 2
fi
IFS=, read -r -a wanted <<< "$platforms"
built=()
for platform in "${wanted[@]}"; do
  case "$platform" in
    linux/amd64) built+=("$platform") ;;
    linux/arm64)
      if [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || [ "$(uname -m)" = aarch64 ]; then
        built+=("$platform")
      else
        echo "image.sh: no arm64 emulation here (binfmt qemu-aarch64 not registered): building without linux/arm64; build it on a machine that can" >&2
      fi ;;
    *) echo "image.sh: unsupported platform: $platform (linux/amd64, linux/arm64)" >&2; exit 2 ;;
  esac
done

if [ ${#built[@]} -eq 0 ]; then
  echo "image.sh: no platform of $platforms can be built here" >&2
  exit 2
fi
version=$(sed -n 's/^appVersion: "\(.*\)"/\1/p' deploy/helm/nodeagent/Chart.yaml)
name="${push:-localhost/nodeagent}"
run() {
  if [ "$dry_run" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
run buildah manifest create "$name:$version"
for platform in "${built[@]}"; do
  run buildah build --isolation chroot --layers --platform "$platform" \
    --build-arg "REVISION=$(git rev-parse HEAD)" --manifest "$name:$version" .
done
if [ -n "$push" ]; then
  run buildah manifest push --all --digestfile image.digest "$name:$version" "docker://$name:$version"
  digest=$( [ "$dry_run" = 1 ] && echo "sha256:DIGEST" || cat image.digest )
  echo "digest: $digest"
  printf 'helm install nodeagent deploy/helm/nodeagent -n nodeagent --set image.repository=%q --set image.digest=%q\n' "$name" "$digest"
fi
