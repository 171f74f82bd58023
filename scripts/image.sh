#!/usr/bin/env bash
# Build the agent's image with buildah (as the tests do) for the platforms this machine can,
# write the SBOM of its Python environment, push it, print the digest and the helm line
# that pins it.
#   scripts/image.sh [--push REGISTRY/REPO] [--platform linux/amd64,linux/arm64]
#                    [--base IMAGE] [--pip-ca FILE] [--out DIR] [--dry-run]
# Without --push the manifest list goes to an OCI layout, OUT/oci (copy it to a registry
# later: skopeo copy --all oci:OUT/oci:VERSION docker://REGISTRY/REPO:VERSION); its digest is
# the one the registry will show. OUT (default build/image) also gets digest and
# sbom.cdx.json (CycloneDX JSON, the Dockerfile's sbom stage: cyclonedx-bom run on the
# image's own venv). --base replaces debian:bookworm-slim (a mirror, or a digest-pinned
# base); --pip-ca gives the build's pip a CA bundle (a TLS-inspecting proxy's) as a build
# secret. --dry-run prints each command (one argv per line) instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."

push=""
platforms="linux/amd64"
base="debian:bookworm-slim"
pip_ca=""
out="build/image"
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push="${2-}"; shift 2 || { echo "image.sh: --push needs REGISTRY/REPO" >&2; exit 2; } ;;
    --platform) platforms="${2-}"; shift 2 || { echo "image.sh: --platform needs a list" >&2; exit 2; } ;;
    --base) base="${2-}"; shift 2 || { echo "image.sh: --base needs an image" >&2; exit 2; } ;;
    --pip-ca) pip_ca="${2-}"; shift 2 || { echo "image.sh: --pip-ca needs a file" >&2; exit 2; } ;;
    --out) out="${2-}"; shift 2 || { echo "image.sh: --out needs a directory" >&2; exit 2; } ;;
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
# An image reference: [registry[:port]/]path[:tag][@sha256:hex], nothing else.
base_re='^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$'
if ! [[ "$base" =~ $base_re ]]; then
  echo "image.sh: --base wants an image reference, not: $base" >&2
  exit 2
fi
if [ -n "$pip_ca" ] && ! [ -f "$pip_ca" ]; then
  echo "image.sh: --pip-ca: no such file: $pip_ca" >&2
  exit 2
fi
if [ -z "$out" ] || [[ "$out" == -* ]]; then
  echo "image.sh: --out wants a directory, not: $out" >&2
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
common=(--isolation chroot --layers --build-arg "BASE_IMAGE=$base")
if [ -n "$pip_ca" ]; then common+=(--secret "id=pip-ca,src=$pip_ca"); fi
# A list of the same name from an earlier run would be added to, not replaced.
if [ "$dry_run" = 0 ] && buildah manifest inspect "$name:$version" >/dev/null 2>&1; then
  buildah manifest rm "$name:$version" >/dev/null
fi
run buildah manifest create "$name:$version"
for platform in "${built[@]}"; do
  run buildah build "${common[@]}" --platform "$platform" \
    --build-arg "VERSION=$version" --build-arg "REVISION=$(git rev-parse HEAD)" \
    --manifest "$name:$version" .
done
run mkdir -p "$out"
run buildah build "${common[@]}" --target sbom --output "type=local,dest=$out" .
if [ -n "$push" ]; then
  dest="docker://$name:$version"
else
  run rm -rf "$out/oci"
  dest="oci:$out/oci:$version"
fi
run buildah manifest push --all --digestfile "$out/digest" "$name:$version" "$dest"
digest=$( [ "$dry_run" = 1 ] && echo "sha256:DIGEST" || cat "$out/digest" )
echo "digest: $digest"
echo "sbom: $out/sbom.cdx.json"
if [ -n "$push" ]; then
  printf 'helm install nodeagent deploy/helm/nodeagent -n nodeagent --set image.repository=%q --set image.digest=%q\n' "$name" "$digest"
else
  echo "pushed nowhere: skopeo copy --all oci:$out/oci:$version docker://REGISTRY/REPO:$version, then helm install ... --set image.repository=REGISTRY/REPO --set image.digest=$digest"
fi
