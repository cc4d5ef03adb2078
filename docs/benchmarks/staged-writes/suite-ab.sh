#!/bin/bash
cd /work/main
for r in 1 2; do
  for b in b-60c b-stage; do
    ./target/release/betreefs-bench --fs betreefs --suite ${SUITE:-micro} --scale default --rounds 1 --out /var/tmp/stageab/${SUITE:-micro}-$b-$r --workdir /var/tmp/stageab/w --betreefs /var/tmp/sr/$b > /var/tmp/stageab/${SUITE:-micro}-$b-$r.log 2>&1
  done
done
