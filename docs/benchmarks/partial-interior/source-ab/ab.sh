#!/bin/bash
# The source suite, betreefs alone: the build before this session (7f05692,
# OLD) and this one (NEW), alternated; one pair of runs per round named on
# the command line (this session: `ab.sh 1 2` at ad58299, `ab.sh 3 4` with
# the completion rule at 8 segments, `ab.sh 5 6` at 4, as committed).
OLD=${OLD:-/var/tmp/old-target/release/betreefs}
NEW=${NEW:-/work/main/target/release/betreefs}
cd /work/main
for round in "$@"; do
  for b in old new; do
    if [ $b = old ]; then BIN=$OLD; else BIN=$NEW; fi
    ./target/release/betreefs-bench --fs betreefs --suite source --scale default --rounds 1 --betreefs "$BIN" \
      --out /var/tmp/b10/ab-$b-$round --workdir /var/tmp/b10/wab > /var/tmp/b10/ab-$b-$round.log 2>&1
  done
done
