#!/usr/bin/env bash
# A private PostgreSQL server for the ledger tests (Debian's postgresql package).
#
#   eval "$(bash scripts/test-setup.sh)"     # start (or reuse) it; exports MOESWARM_TEST_PG_URL
#   bash scripts/test-setup.sh stop          # stop it
#
# Installs postgresql with apt-get if no server binaries are found (needs root), creates a cluster
# in $MOESWARM_PG_DIR (default: $TMPDIR/moeswarm-test-pg) owned by the postgres user when run as
# root, listening only on a Unix socket in that folder (port number $MOESWARM_PG_PORT, default
# 54329, names the socket file: nothing listens on TCP), and a database moeswarm_test.
# Progress goes to stderr; stdout carries only the export line, so eval is safe.
set -euo pipefail

PGDIR=${MOESWARM_PG_DIR:-${TMPDIR:-/tmp}/moeswarm-test-pg}
PORT=${MOESWARM_PG_PORT:-54329}
DB=moeswarm_test
log() { echo "test-setup: $*" >&2; }

find_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    if [ -x "$d/pg_ctl" ] && [ -x "$d/initdb" ]; then echo "$d"; fi
  done | sort -V | tail -n 1
}

BIN=$(find_bin)
if [ -z "$BIN" ]; then
  if [ "$(id -u)" != 0 ]; then
    log "PostgreSQL is not installed; as root run: apt-get install -y postgresql"; exit 1
  fi
  log "installing Debian's postgresql"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
  BIN=$(find_bin)
  [ -n "$BIN" ] || { log "postgresql installed but no pg_ctl found"; exit 1; }
fi

# As root, run the server as the postgres user (PostgreSQL refuses to run as root).
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
  as_pg() { runuser -u postgres -- "$@"; }
  OWNER=postgres
else
  as_pg() { "$@"; }
  OWNER=$(id -un)
fi

DATA=$PGDIR/data
RUN=$PGDIR/run

if [ "${1:-start}" = stop ]; then
  if [ -f "$DATA/postmaster.pid" ]; then as_pg "$BIN/pg_ctl" -D "$DATA" -m "${MOESWARM_PG_STOP_MODE:-fast}" -w stop >&2; fi
  exit 0
fi

mkdir -p "$PGDIR"
chmod 755 "$PGDIR"
if [ ! -f "$DATA/PG_VERSION" ]; then
  log "creating a cluster in $DATA"
  mkdir -p "$DATA" "$RUN"
  chown "$OWNER" "$DATA" "$RUN"
  chmod 700 "$DATA"
  as_pg "$BIN/initdb" -D "$DATA" -U postgres -A trust -E UTF8 --no-locale >"$PGDIR/initdb.log" 2>&1 \
    || { cat "$PGDIR/initdb.log" >&2; exit 1; }
fi
if ! as_pg "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
  log "starting PostgreSQL ($BIN) on socket $RUN/.s.PGSQL.$PORT"
  as_pg "$BIN/pg_ctl" -D "$DATA" -l "$RUN/server.log" -w -t 60 \
    -o "-c listen_addresses='' -k $RUN -p $PORT -c max_connections=100" start >&2 \
    || { tail -n 20 "$RUN/server.log" >&2; exit 1; }
fi
if ! as_pg "$BIN/psql" -h "$RUN" -p "$PORT" -U postgres -d postgres -tAc \
     "SELECT 1 FROM pg_database WHERE datname = '$DB'" | grep -q 1; then
  as_pg "$BIN/createdb" -h "$RUN" -p "$PORT" -U postgres "$DB"
fi
echo "export MOESWARM_TEST_PG_URL='postgresql+psycopg://postgres@/$DB?host=$RUN&port=$PORT'"
