#!/bin/bash
# source suite, betreefs alone: the build before this session (7f05692) and this one, alternated
cd /work/main
for round in 1 2; do
  for b in old new; do
    if [ $b = old ]; then BIN=/var/tmp/old-target/release/betreefs; else BIN=/work/main/target/release/betreefs; fi
    ./target/release/betreefs-bench --fs betreefs --suite source --scale default --rounds 1 --betreefs $BIN \
      --out /var/tmp/b10/ab-$b-$round --workdir /var/tmp/b10/wab > /var/tmp/b10/ab-$b-$round.log 2>&1
  done
done
