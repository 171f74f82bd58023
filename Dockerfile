# nodeagent's image: the wheel installed into a venv, on a slim Python base.
#   docker build --build-arg REVISION=$(git rev-parse HEAD) -t nodeagent:0.1.0 .
# The build stage needs no compiler: every dependency ships binary wheels.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY nodeagent ./nodeagent
COPY scripts/install-venv.sh ./scripts/
RUN sh scripts/install-venv.sh /src /opt/nodeagent /wheels

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="nodeagent" \
      org.opencontainers.image.description="Orders kernel-module loads on GPU/RDMA nodes (nvidia_peermem, MOFED, storage chain, SR-IOV VFs)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# libkmod2: the agent loads modules through libkmod (ctypes); kmod: its tools, for
# operators in the pod; libudev1: pyudev's kernel uevent monitor.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libkmod2=30+20221128-1 kmod=30+20221128-1 libudev1=252.39-1~deb12u2 \
 && rm -rf /var/lib/apt/lists/* \
 && python -m pip uninstall --yes --quiet pip setuptools wheel
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
