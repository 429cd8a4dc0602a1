#!/usr/bin/env bash
# Stop the one-node cluster that scripts/slurm/start.sh started: cancel its jobs, then end
# slurmd, slurmctld and (only if start.sh started it) munged, each by the PID recorded in STATE_DIR.
#
#   scripts/slurm/stop.sh [STATE_DIR]      # default /tmp/eaglet-slurm
set -uo pipefail

STATE=$(realpath -m "${1:-/tmp/eaglet-slurm}")
[ -d "$STATE" ] || { echo "stop.sh: $STATE: no such state folder" >&2; exit 0; }
export SLURM_CONF="$STATE/slurm.conf"

if [ -s "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
    scancel --full --user "$(id -un)" 2>/dev/null || true
fi

stop_pid() {  # name
    local f="$STATE/$1.pid" pid
    [ -s "$f" ] || return 0
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
        echo "stop.sh: stopped $1 (pid $pid)" >&2
    fi
    rm -f "$f"
}
stop_pid slurmd
stop_pid slurmctld
stop_pid munged
if [ -s "$STATE/etc_link" ]; then
    link=$(cat "$STATE/etc_link")
    # only the symlink start.sh made, and only while it still points here
    [ "$(readlink "$link")" = "$STATE/slurm.conf" ] && rm -f "$link"
    rm -f "$STATE/etc_link"
fi
exit 0
