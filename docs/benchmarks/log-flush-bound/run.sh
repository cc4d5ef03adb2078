#!/bin/bash
# The hand runs of log-flush-bound.md, as root, from the repository's root:
# OLD= the betreefs binary before (3ad831a), NEW= after (default: this checkout's).
# seqw.sh (2 GiB sequential write) then stall.sh (untar + 4 KiB write/fsync loop),
# builds alternated, two rounds each.
set -u
NEW=${NEW:-$(pwd)/target/release/betreefs}
OLD=${OLD:?the binary before}
here=$(dirname "$0")
for r in 1 2; do
  for B in "$OLD" "$NEW"; do bash "$here/../write-back-unlocked/seqw.sh" "$B"; done
done
for r in 1 2; do
  for B in "$OLD" "$NEW"; do
    echo "== stall $B round $r"
    B=$B SECS=30 bash "$here/../settle-steps/stall.sh" 2>&1 |
      grep -E "fsync loop|apply_micros_max|settle_step_micros_max|evict_micros_max|checkpoint_micros_max|peak_res"
  done
done
