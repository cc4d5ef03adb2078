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
bash "$here/../settle-steps/stall-ab.sh" "$OLD" "$NEW"
