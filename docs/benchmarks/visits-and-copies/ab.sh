#!/bin/bash
# ab.sh ROUND BIN...: betreefs-only micro and source suites for each binary (in /var/tmp/s15) in turn
# run: ab.sh 1 b-base b-turns; ab.sh 2 b-turns b-base
r=$1; shift
for b in "$@"; do
  for suite in micro source; do
    /work/main/target/release/betreefs-bench --fs betreefs --suite $suite --scale default --rounds 1 --betreefs /var/tmp/s15/$b \
      --out /var/tmp/s15/ab/$suite-$b-$r --workdir /var/tmp/s15/abw > /var/tmp/s15/ab/$suite-$b-$r.log 2>&1
  done
done
