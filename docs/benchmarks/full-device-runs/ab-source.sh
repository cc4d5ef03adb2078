#!/bin/bash
# Alternated source-suite runs of two builds: OLD (a build of 8ec7433 in
# its own target directory) and NEW (this checkout's release build).
OLD=${OLD:-/var/tmp/s30/old-target/release/betreefs}
NEW=${NEW:-/work/main/target/release/betreefs}
OUT=${OUT:-/var/tmp/s30/ab}
cd "$(dirname "$0")/../../.."
for r in 1 2; do
  for b in old new; do
    if [ $b = old ]; then BIN=$OLD; else BIN=$NEW; fi
    rm -rf $OUT/work-$b-$r
    ./target/release/betreefs-bench --fs betreefs --suite source --scale default --rounds 1 \
      --betreefs $BIN --out $OUT/out-$b-$r --workdir $OUT/work-$b-$r > $OUT/log-$b-$r 2>&1
    rm -rf $OUT/work-$b-$r
  done
done
echo done > $OUT/done
