#!/bin/bash
# The hand runs of write-back-unlocked.md, as root, from the repository's root:
# OLD= the betreefs binary before (8b967f4), NEW= after (3ad831a; default: this checkout's).
# 1. kv-bench WS3 at 50% reads, 1 and 2 client threads (kv.txt);
# 2. stall.sh of settle-steps.md: untar + 4 KiB write/fsync loop (stall.txt);
# 3. seqw.sh: 2 GiB sequential write (seqw.txt). Builds alternated, two rounds each.
set -u
NEW=${NEW:-$(pwd)/target/release/betreefs}
OLD=${OLD:?the binary before}
here=$(dirname "$0")
mkdir -p /var/tmp/kvscale
for r in 1 2; do
  for B in "$OLD" "$NEW"; do
    for t in 1 2; do
      rm -f /var/tmp/kvscale/s.img
      line=$($B kv-bench --path /var/tmp/kvscale/s.img --workload ws3 --reads 50 --keys 1000000 \
          --ops 2000000 --threads $t --stats 2>/var/tmp/kvscale/stats.json)
      echo "$B t=$t $line $(tail -1 /var/tmp/kvscale/stats.json)"
    done
  done
done
rm -f /var/tmp/kvscale/s.img
bash "$here/../settle-steps/stall-ab.sh" "$OLD" "$NEW"
for r in 1 2; do
  for B in "$OLD" "$NEW"; do bash "$here/seqw.sh" "$B"; done
done
