#!/bin/bash
# alternates builds through the micro suite, betreefs alone: mem-ab.sh ROUND... (builds in $BUILDS)
cd /work/main
for r in "$@"; do for b in $BUILDS; do
  ./target/release/betreefs-bench --fs betreefs --suite micro --scale default --rounds 1 --betreefs /var/tmp/s12/$b \
    --out /var/tmp/s12/ab-$b-$r --workdir /var/tmp/s12/w > /var/tmp/s12/ab-$b-$r.log 2>&1
done; done
