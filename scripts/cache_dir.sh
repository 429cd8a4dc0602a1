#!/usr/bin/env bash
# Create the between-workflow output cache ($SNAKEMAKE_OUTPUT_CACHE) and its parent folder
# owner-only (0700), or group-only (2770, setgid) when EAGLET_CACHE_GROUP names a group to share it
# with; a folder that exists with a more open mode is closed to that mode.
#
# Why: Snakemake's local cache makes every file it stores 0666 and every folder 0777, by design.
# Under a 0755 parent any local user could then alter an artifact that later runs trust. Snakemake
# never changes the mode of the cache folder itself, so closing it and its parent closes the cache.
# The parent is left alone when it is $HOME or not ours (e.g. /scratch): the cache folder suffices.
# A cache folder owned by someone else is refused: whoever owns it can alter what it serves.
#
#   SNAKEMAKE_OUTPUT_CACHE=~/.cache/eaglet/snakemake-cache [EAGLET_CACHE_GROUP=mlteam] scripts/cache_dir.sh
set -euo pipefail

cache="${SNAKEMAKE_OUTPUT_CACHE:?SNAKEMAKE_OUTPUT_CACHE is not set}"
group="${EAGLET_CACHE_GROUP:-}"
if [[ -n "$group" ]]; then
    getent group "$group" >/dev/null || { echo "EAGLET_CACHE_GROUP=$group: no such group" >&2; exit 1; }
    mode=2770
else
    mode=700
fi

close() {  # close DIR [strict]: create or fix DIR with $mode (and $group); strict = refuse if not ours
    local dir="$1" strict="${2:-}"
    if [[ ! -d "$dir" ]]; then
        mkdir -p "$(dirname "$dir")"
        mkdir -m "$mode" "$dir"
    elif [[ "$(stat -c %u "$dir")" != "$(id -u)" ]]; then
        if [[ -n "$strict" ]]; then
            echo "SNAKEMAKE_OUTPUT_CACHE=$cache: owned by $(stat -c %U "$dir"), not by you: refusing to use it" >&2
            exit 1
        fi
        return 0
    fi
    [[ -n "$group" ]] && chgrp "$group" "$dir"
    chmod "$mode" "$dir"
}

parent="$(dirname "$(realpath -m "$cache")")"
if [[ "$parent" != "$(realpath -m "$HOME")" && "$parent" != "/" ]]; then
    close "$parent"
fi
close "$cache" strict
