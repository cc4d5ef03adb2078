#!/bin/bash
# kv-bench thread scaling: old (cb1936d engine) vs new, interleaved, 2 rounds.
out=/var/tmp/kvscale/results.jsonl
: > $out
for round in 1 2; do
  for reads in 50 90 100; do
    for threads in 1 2 4; do
      for build in old new; do
        if [ $build = old ]; then bin=/tmp/old-target/release/betreefs; else bin=/work/main/target/release/betreefs; fi
        line=$($bin kv-bench --path /var/tmp/kvscale/s.img --workload ws3 --reads $reads --keys 1000000 --ops 2000000 --threads $threads --stats 2>/var/tmp/kvscale/stats.json)
        stats=$(tail -1 /var/tmp/kvscale/stats.json)
        echo "{\"build\":\"$build\",\"round\":$round,\"result\":$line,\"stats\":$stats}" >> $out
      done
    done
  done
done
rm -f /var/tmp/kvscale/s.img
