# syntax=docker/dockerfile:1
# vLLM's release image of the pinned version with the DDTree patch series applied to
# the vLLM installed in it. Build with tools/build-image.sh: it passes the pins from
# UPSTREAM and adds the series hash read back from the built image as a label.

# Keep in step with BASE_IMAGE in UPSTREAM (tests/deploy checks it).
ARG BASE_IMAGE=vllm/vllm-openai:v0.26.0
# checkov:skip=CKV_DOCKER_7: the tag comes from ARG BASE_IMAGE, pinned to a release above; checkov does not resolve ARGs
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
# Keep in step with VLLM_VERSION in UPSTREAM (tests/deploy checks it).
ARG VLLM_VERSION=0.26.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/vllm-ddtree
COPY UPSTREAM apply.sh pyproject.toml ./
COPY patches/ patches/
COPY vllm_ddtree/ vllm_ddtree/
COPY tools/ tools/
COPY deploy/entrypoint.sh deploy/check_install.py deploy/

# Patch the image's own vLLM (its dist-packages) exactly as on any installed vLLM;
# apply.sh also copies vllm_ddtree beside vllm and writes the series manifest.
RUN ./apply.sh --site "$(python3 -c 'import vllm,os;print(os.path.dirname(os.path.dirname(vllm.__file__)))')"

# Import check: the pinned vLLM, vllm_ddtree beside it, a manifest that matches both,
# and the OpenAI server (which loads the engine, config and speculative decoding code).
RUN python3 deploy/check_install.py --vllm-version "${VLLM_VERSION}" \
        --import vllm.entrypoints.openai.api_server

# Ray is needed only for the multi-node deployment (vLLM's Ray executor; see
# deploy/README.md) and vLLM's wheel does not depend on it: add it with
# --build-arg RAY_PACKAGE='ray[default]==<version>' (DL3013 is ignored below because
# the pin is in that argument, and the RUN refuses one without a version).
ARG RAY_PACKAGE=""
# hadolint ignore=DL3013
RUN if [ -n "${RAY_PACKAGE}" ]; then \
        case "${RAY_PACKAGE}" in *==*) ;; *) echo "RAY_PACKAGE must pin a version: ray[default]==X.Y.Z" >&2; exit 1 ;; esac; \
        python3 -m pip install --no-cache-dir "${RAY_PACKAGE}"; \
    fi

# vLLM's image runs as root. Run as UID 10001 in group 0 instead, with HOME and every
# cache under /home/vllm, group-writable so that an arbitrary UID in group 0
# (OpenShift's restricted policy) works too. Kubernetes mounts emptyDirs over the
# cache directories when the root filesystem is read-only.
RUN useradd --no-log-init --uid 10001 --gid 0 --create-home --home-dir /home/vllm --shell /bin/bash vllm \
    && mkdir -p /home/vllm/.cache /home/vllm/.config \
    && chown -R 10001:0 /home/vllm \
    && chmod -R g=u /home/vllm
ENV HOME=/home/vllm \
    XDG_CACHE_HOME=/home/vllm/.cache \
    XDG_CONFIG_HOME=/home/vllm/.config \
    HF_HOME=/home/vllm/.cache/huggingface \
    TRITON_CACHE_DIR=/home/vllm/.cache/triton \
    VLLM_NO_USAGE_STATS=1 \
    PORT=8000

LABEL org.opencontainers.image.title="vllm-ddtree" \
      org.opencontainers.image.description="vLLM ${VLLM_VERSION} with DDTree speculative decoding (patch series applied)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.github.vllm-ddtree.vllm-version="${VLLM_VERSION}"

WORKDIR /home/vllm
USER 10001:0
EXPOSE 8000

# Model loading, torch.compile and CUDA graph capture take minutes before /health answers.
HEALTHCHECK --start-period=900s --interval=30s --timeout=5s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8000'), timeout=4)"]

ENTRYPOINT ["/opt/vllm-ddtree/deploy/entrypoint.sh"]
