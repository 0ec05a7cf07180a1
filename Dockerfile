# The serving image: Gemma-4 26B-A4B on one inf2.xlarge (2 NeuronCores, 16 GB host RAM).
#
#   docker build -t gemma4-optb .
#   docker run --device=/dev/neuron0 -p 8080:8080 -v gemma4-data:/data --stop-timeout 40 gemma4-optb
#
# The first start fetches the artifacts into the /data volume (see entrypoint.sh); later starts reuse them.
#
# The base is the exact Neuron stack the published 26B graph was compiled with (torch 2.9, NxD 0.19,
# SDK 2.31.1): a compiled graph only loads on the runtime and torch-neuronx it was built against.
FROM public.ecr.aws/neuron/pytorch-inference-neuronx:2.9.0-neuronx-py312-sdk2.31.1-ubuntu24.04

# bash with pipefail, so a failing `pip list` inside a pipe fails the build instead of yielding empty pins.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Only requirements.txt goes on top of the image, and it must not move the Neuron stack: requirements.txt
# lists no torch, and the constraints pin what the image ships (torch, torch-xla, torch-neuronx, NxD, the
# compiler, numpy under their compiled extensions), so a dependency asking for another version fails the build
# here instead of silently breaking the graph load.
# transformers: Gemma-4 needs 5.x. NxD itself declares no transformers requirement (only torch-neuronx,
# torch-xla, safetensors); its one transformers import, transformers.utils.fx, gone in 5.x, is stood in for by
# server/vendor/neuron_prelude.py. NxD Inference pins transformers==4.57.*, and nothing here uses it: it is
# removed, so the environment is consistent rather than one pin silently broken.
# `pip check` before and after: the base installs NxD with --no-deps and may carry reports of its own; the build
# fails only on a report our install added (a package of the image whose declared needs we broke).
COPY requirements.txt /app/requirements.txt
RUN pip list --format=freeze | grep -iE '^(torch|torch[-_]xla|torch[-_]neuronx|torchvision|neuronx[-_]cc|neuronx[-_]distributed|libneuronxla|numpy)==' \
        > /tmp/neuron-stack.txt \
 && grep -iq '^torch==' /tmp/neuron-stack.txt \
 && { pip check > /tmp/pip-check-base.txt || true; } \
 && pip uninstall -y neuronx-distributed-inference \
 && pip install -c /tmp/neuron-stack.txt -r /app/requirements.txt \
 && pip list --format=freeze | grep -iE '^torch==' | cmp - <(grep -iE '^torch==' /tmp/neuron-stack.txt) \
 && { pip check > /tmp/pip-check-ours.txt || true; } \
 && if comm -13 <(sort /tmp/pip-check-base.txt) <(sort /tmp/pip-check-ours.txt) | grep . >&2; then \
        echo "requirements.txt broke what the image's packages declare they need (above)" >&2; exit 1; \
    fi \
 && rm -f /tmp/neuron-stack.txt /tmp/pip-check-base.txt /tmp/pip-check-ours.txt

COPY server/ /app/server/
COPY entrypoint.sh /app/entrypoint.sh
# Import the server against the image's torch now: a dependency clash fails the build, not the first start
# on the inf2 host (nothing here touches a NeuronCore, so any build machine can run it). That includes NxD's
# model builder next to transformers 5, exactly as the graph load imports it.
RUN chmod 0755 /app/entrypoint.sh \
 && python -c "import server.app.serve, server.tools.fetch, server.app.runtime" \
 && python -c "from server.vendor.neuron_prelude import prepare_neuron_imports as p; assert p(), 'no NxD'" \
 && python -m server check --help > /dev/null

# Both NeuronCores (the range form AWS documents): the graph is compiled for tensor parallelism 2.
# No Xet chunk cache: it would keep up to 10 GB of a one-time download in the container's writable layer,
# on the same disk as the /data volume, behind the back of fetch's free-space check.
# Start-up caches (derived model structure, fast-loading tokenizer) on the volume: they survive the container.
ENV NEURON_RT_VISIBLE_CORES=0-1 \
    HOST=0.0.0.0 \
    PORT=8080 \
    ARTIFACTS_DIR=/data \
    GEMMA4_OPTB_CACHE=/data/.cache \
    HF_XET_CHUNK_CACHE_SIZE_BYTES=0

# Two malloc arenas, not glibc's 8 per core: the server's threads (HTTP, the device thread, the host workers) each
# took an arena of their own, and the heap crept with them. `python -m server bench soak --minutes 30` (every kind of
# request, 6 clients): RssAnon 601 MB at 30 min, 0.76 MB/min over the last 20, against 564 MB, 0.35 MB/min with
# MALLOC_ARENA_MAX=2; TTFT and inter-token gaps the same (docs/operations.md).
ENV MALLOC_ARENA_MAX=2

EXPOSE 8080
VOLUME /data

# start-period: the first start may download up to ~50 GB (at an EBS gp3 volume's baseline 125 MB/s, ~7 min
# to write and as long again to verify the hashes) and then loads the graph (~112 s, longer while it swaps):
# ~20 min; 30 min leaves margin for a slower link. Failures inside the period do not count and the first
# success ends it, so a restart on a complete volume is reported healthy as soon as the graph is loaded.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30m --retries=3 \
    CMD curl -fsS --max-time 8 "http://127.0.0.1:${PORT:-8080}/health" > /dev/null || exit 1

# Our entrypoint, not the base image's (TorchServe's launcher); CMD reset so nothing of the base's is passed.
ENTRYPOINT ["/app/entrypoint.sh"]
CMD []
