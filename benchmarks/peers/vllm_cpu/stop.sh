#!/usr/bin/env bash
# stop.sh PID: SIGTERM to a server serve.sh started (its engine processes exit with it);
# SIGKILL after 60 s.
set -u
PID=${1:?usage: stop.sh PID}
kill -TERM "$PID" 2>/dev/null || { echo "no process $PID"; exit 1; }
for _ in $(seq 1 60); do kill -0 "$PID" 2>/dev/null || break; sleep 1; done
kill -0 "$PID" 2>/dev/null && kill -KILL "$PID"
echo "stopped $PID"
