#!/bin/bash
# The eviction A/B of settle-steps.md, as root, from the repository's root:
# OLD= the betreefs binary before eviction in steps (e2dfa6f), NEW= after (default: this checkout's).
# kv-bench WS3 at 50% reads, 1 and 2 threads, interleaved, 2 rounds (kept as kv-evict.jsonl),
# then one stall.sh run each (kept as stall-evict.txt).
set -u
NEW=${NEW:-$(pwd)/target/release/betreefs}
OLD=${OLD:?the binary before}
here=$(dirname "$0")
mkdir -p /var/tmp/kvscale
out=/var/tmp/kvscale/evict-steps.jsonl; : > $out
for r in 1 2; do for v in new old; do B=$NEW; [ $v = old ] && B=$OLD
  for t in 1 2; do rm -f /var/tmp/kvscale/s.img
    line=$($B kv-bench --path /var/tmp/kvscale/s.img --workload ws3 --reads 50 --keys 1000000 \
        --ops 2000000 --threads $t --stats 2>/var/tmp/kvscale/stats.json)
    stats=$(tail -1 /var/tmp/kvscale/stats.json)
    echo "{\"build\":\"$v\",\"round\":$r,\"result\":$line,\"stats\":$stats}" >> $out
  done; done; done
rm -f /var/tmp/kvscale/s.img
for v in new old; do B=$NEW; [ $v = old ] && B=$OLD
  echo "== stall $v"; B=$B SECS=30 bash "$here/stall.sh" 2>&1 | grep -E "fsync loop|apply_micros_max|settle|evict|checkpoint_micros_max"
done
