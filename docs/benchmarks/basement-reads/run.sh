#!/bin/bash
# kv-bench: 74d3dbe (basements of cached leaves read under the exclusive
# lock) vs ee571dc (read holding no lock), interleaved, 2 rounds.
# old: git worktree add /tmp/old-tree 74d3dbe && CARGO_TARGET_DIR=/tmp/old-target cargo build --release -p betreefs-cli
out=/var/tmp/kvscale/basement-reads.jsonl
mkdir -p /var/tmp/kvscale
: > $out
for round in 1 2; do
  for reads in 50 90; do
    for threads in 1 2; do
      for build in old new; do
        if [ $build = old ]; then bin=/tmp/old-target/release/betreefs; else bin=/work/main/target/release/betreefs; fi
        line=$($bin kv-bench --path /var/tmp/kvscale/s.img --workload ws3 --reads $reads --keys 1000000 --ops 2000000 --threads $threads --stats 2>/var/tmp/kvscale/stats.json)
        stats=$(tail -1 /var/tmp/kvscale/stats.json)
        echo "{\"build\":\"$build\",\"round\":$round,\"result\":$line,\"stats\":$stats}" >> $out
        rm -f /var/tmp/kvscale/s.img
      done
    done
  done
done
