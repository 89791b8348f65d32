# The gpuscope image: server, NVML exporter, alert receiver and Locust load tests.
# Built by docker-compose.yml, which passes the pinned versions (PYTHON_IMAGE, TORCH_VERSION);
# docker-compose.gpu.yml switches TORCH_INDEX_URL to CUDA wheels.
#   docker compose build    (or: docker build --build-arg PYTHON_IMAGE=... --build-arg TORCH_VERSION=... .)
ARG PYTHON_IMAGE
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

# torch first, from the chosen index: a plain requirement would pull the multi-GB CUDA build on CPU.
RUN test -n "${TORCH_VERSION}" || { echo "build with docker compose, or pass --build-arg TORCH_VERSION"; exit 1; } \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# gcc only for the build: it compiles the timer's C hot path (gpuscope/timing/_hotpath.c; without it
# the timer runs its Python hot path) and gpuscope share's preload library, then leaves the image.
# The library gets a fixed path for tenants' LD_PRELOAD (compose's share profile; on Kubernetes the
# controller copies it to the node). /run/gpuscope-share belongs to the image's user, so a named
# volume mounted there starts with that owner (the share controller refuses another user's folder).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install ".[server,loadtest,kubernetes,tracing]" \
 && python -c "from gpuscope.timing import hot; assert hot.native_available(), 'C hot path not built'" \
 && python -c "from gpuscope.share.preload import library_path; assert library_path(), 'share preload library not built'" \
 && ln -s "$(python -m gpuscope.share.preload)" /usr/local/lib/libgpuscope-share.so \
 && install -d -m 0755 -o 10001 -g 10001 /run/gpuscope-share \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
COPY loadtest ./loadtest

# Non-root; compose runs it with a read-only root filesystem and a tmpfs /tmp (HOME above).
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gpuscope
USER 10001
EXPOSE 8000 9400 9095 8089 9402
ENTRYPOINT ["gpuscope"]
CMD ["--help"]
