# nodeagent's image: Debian's own Python 3.11, the agent and its wheels in a venv.
#   docker build --build-arg REVISION=$(git rev-parse HEAD) -t nodeagent:0.1.0 .
# The base is Debian's, not python:3.11-slim: that image's Python is built from
# source into /usr/local, so no test here can make the base it runs on; Debian's
# python3 can be bootstrapped from Debian's packages, and tests/test_image.py
# builds this very file on such a base. Releases pin the base by digest:
#   --build-arg BASE_IMAGE=debian:bookworm-slim@sha256:<digest>
# No compiler anywhere: every dependency ships a binary wheel.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS build
# Versions come with the base image's release (pinned by its digest); pinning exact
# Debian revisions here breaks at the next point release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The dependencies in a layer of their own, before the source: a change to the
# agent rebuilds only the last step.
# Behind a TLS-inspecting proxy, pass its CA bundle as a build secret (never a layer):
#   docker build --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt .
COPY pyproject.toml ./
COPY scripts/install-venv.sh ./scripts/
RUN --mount=type=secret,id=pip-ca,required=false \
    sh scripts/install-venv.sh deps /src /opt/nodeagent
COPY README.md ./
COPY nodeagent ./nodeagent
RUN --mount=type=secret,id=pip-ca,required=false \
    sh scripts/install-venv.sh app /src /opt/nodeagent

# The SBOM of the image's Python environment (CycloneDX JSON), made by cyclonedx-bom from
# the very venv the image ships, in a stage the image never contains. scripts/image.sh:
#   buildah build --target sbom --output type=local,dest=DIR .    # DIR/sbom.cdx.json
# (a plain build skips both stages: they do not affect the final one).
FROM build AS sbom-build
RUN --mount=type=secret,id=pip-ca,required=false \
    sh scripts/install-venv.sh sbom /src /opt/nodeagent /sbom.cdx.json
FROM scratch AS sbom
COPY --from=sbom-build /sbom.cdx.json /

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="nodeagent" \
      org.opencontainers.image.description="Orders kernel-module loads on GPU/RDMA nodes (nvidia_peermem, MOFED, storage chain, SR-IOV VFs)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# python3: the venv's interpreter (no pip, no venv module at run time); libkmod2:
# the agent loads modules through libkmod (ctypes); kmod: its tools, for operators
# in the pod; libudev1: pyudev's kernel uevent monitor.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libkmod2 kmod libudev1 \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/apt /var/log/dpkg.log
COPY --from=build /opt/nodeagent /opt/nodeagent
ENV PATH=/opt/nodeagent/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NODEAGENT_HOST_ROOT=/host
# Non-root by default (nodeagent check/status/wait need nothing more). The
# DaemonSet runs the daemon as uid 0 with only CAP_SYS_MODULE and CAP_NET_ADMIN:
# Kubernetes cannot give a non-root process capabilities (no ambient caps).
USER 65532:65532
ENTRYPOINT ["nodeagent"]
CMD ["run"]
