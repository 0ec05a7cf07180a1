#!/usr/bin/env bash
# The container's entrypoint: make sure the artifact directory is complete (fetching it once into the volume
# when it is not), warn when the host cannot hold the one-time graph load (graphs whose weights load from
# memory-mapped per-rank files need no swap), then become the server.
#
# Interface (environment):
#   ARTIFACTS_DIR  artifact directory, normally the /data volume      (default /data)
#   GRAPH          auto | jit | hf | null                             (default auto)
#   HOST, PORT     where the server listens                           (default 0.0.0.0, 8080)
#   HF_REPO        Hub repo fetched when the directory is incomplete  (default the published 26B xlarge build)
#   HF_REVISION    branch, tag or commit of HF_REPO                   (default main)
#   HF_TOKEN       optional: the published repo is public
#   MIN_MEMORY_GB  RAM + swap below which the load warning is printed (default 48; 0 silences it)
#   PYTHON         interpreter                                        (default python)
# Arguments given to the container are passed on to `python -m server serve` (flags win over env vars).
set -euo pipefail

PYTHON="${PYTHON:-python}"
ARTIFACTS_DIR="${ARTIFACTS_DIR:-/data}"
GRAPH="${GRAPH:-auto}"
HOST="${HOST:-0.0.0.0}"
PORT="${PORT:-8080}"
HF_REPO="${HF_REPO:-xbill9/gemma-4-26B-A4B-it-inferentia2-xlarge}"
HF_REVISION="${HF_REVISION:-main}"
MIN_MEMORY_GB="${MIN_MEMORY_GB:-48}"

log() {
    printf 'entrypoint: %s\n' "$*" >&2
}

# A v2 graph built with `--weights separate` keeps each rank's weights in its own file, memory-mapped while they
# go to the device: they never pass through anonymous host memory, so the load needs no swap.
weights_are_separate() {
    local spec="$ARTIFACTS_DIR/graph.json"
    [[ -r "$spec" ]] && grep -Eq '"weights"[[:space:]]*:[[:space:]]*"separate"' "$spec"
}

# The compiled graph's weights pass through host memory once on their way to the device: on a 16 GB
# inf2.xlarge that load needs a swapfile (the published build was loaded with 16 GB RAM + 40 GB swap).
# Only a warning: a bigger host, or a smaller graph, loads fine without one.
warn_if_memory_is_short() {
    case "$GRAPH" in
        hf | null) return 0 ;; # no compiled graph to load
    esac
    if weights_are_separate; then
        return 0
    fi
    if [[ ! "$MIN_MEMORY_GB" =~ ^[0-9]+$ ]]; then
        log "MIN_MEMORY_GB=$MIN_MEMORY_GB is not a whole number of GiB; using 48"
        MIN_MEMORY_GB=48
    fi
    if [[ ! -r /proc/meminfo ]]; then
        return 0
    fi
    local have_kib need_kib
    have_kib=$(awk '/^(MemTotal|SwapTotal):/ { sum += $2 } END { print sum + 0 }' /proc/meminfo)
    need_kib=$((MIN_MEMORY_GB * 1024 * 1024))
    if ((have_kib >= need_kib)); then
        return 0
    fi
    log "WARNING: RAM + swap is $((have_kib / 1024 / 1024)) GiB, but loading the compiled graph once needs" \
        "~${MIN_MEMORY_GB} GiB on a 16 GB host; without swap the kernel may kill the server during the load."
    log "Add a 40 GB swapfile on the HOST (swap is the host's, not the container's), then restart:"
    log "    sudo fallocate -l 40G /swapfile"
    log "    sudo chmod 600 /swapfile"
    log "    sudo mkswap /swapfile"
    log "    sudo swapon /swapfile"
    log "(set MIN_MEMORY_GB=0 to silence this warning)"
}

# `check` is quick (no model load) and names every missing file; fetch only when it fails, so a complete
# volume starts the server without touching the network.
if ! reason=$("$PYTHON" -m server check --artifacts "$ARTIFACTS_DIR" --graph "$GRAPH" 2>&1); then
    log "$ARTIFACTS_DIR is not complete for --graph $GRAPH:"
    printf '%s\n' "$reason" >&2
    log "fetching $HF_REPO (revision $HF_REVISION) into $ARTIFACTS_DIR"
    # fetch checks the free disk space first, resumes, verifies hashes and validates; its exit code is ours.
    "$PYTHON" -m server fetch --repo "$HF_REPO" --revision "$HF_REVISION" --dest "$ARTIFACTS_DIR" \
        --graph "$GRAPH" || {
        status=$?
        log "fetch failed (exit $status); not starting the server"
        exit "$status"
    }
fi

# After the fetch: graph.json says whether this graph needs swap to load.
warn_if_memory_is_short

# exec: the server replaces this shell (PID 1 in the container), so `docker stop`'s SIGTERM reaches it
# directly and it can drain in-flight requests.
exec "$PYTHON" -m server serve --artifacts "$ARTIFACTS_DIR" --graph "$GRAPH" --host "$HOST" --port "$PORT" "$@"
