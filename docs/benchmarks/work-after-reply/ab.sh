#!/bin/bash
# ab.sh ROUND BIN...: betreefs-only micro and source suites for each binary in turn
r=$1; shift
for b in "$@"; do
  for suite in micro source; do
    /var/tmp/s14/bench --fs betreefs --suite $suite --scale default --rounds 1 --betreefs /var/tmp/s14/$b \
      --out /var/tmp/s14/ab/$suite-$b-$r --workdir /var/tmp/s14/abw > /var/tmp/s14/ab/$suite-$b-$r.log 2>&1
  done
done
