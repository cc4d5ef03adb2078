#!/bin/bash
# kv-bench WS3 50% reads, data twice the cache: cd663eb (old) vs reads below basements (new), interleaved
mkdir -p ${WORK:-/var/tmp/reads-below-kv}
out=${WORK:-/var/tmp/reads-below-kv}/results.jsonl
: > $out
for round in 1 2; do
  for threads in 1 2; do
    for build in old new; do
      bin=${BIN_OLD:-/tmp/old-target/release/betreefs}; [ $build = new ] && bin=${BIN_NEW:-target/release/betreefs}
      line=$($bin kv-bench --path ${WORK:-/var/tmp/reads-below-kv}/s.img --workload ws3 --reads 50 --keys 1000000 --ops 2000000 --threads $threads --stats 2>${WORK:-/var/tmp/reads-below-kv}/stats.json)
      stats=$(tail -1 ${WORK:-/var/tmp/reads-below-kv}/stats.json)
      echo "{\"build\":\"$build\",\"round\":$round,\"threads\":$threads,\"result\":$line,\"stats\":$stats}" >> $out
      rm -f ${WORK:-/var/tmp/reads-below-kv}/s.img
      echo "$build t$threads r$round: $line" | cut -c1-300
    done
  done
done
