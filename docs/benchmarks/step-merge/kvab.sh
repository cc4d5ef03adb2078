#!/bin/bash
# kvab.sh ROUNDS THREADS BIN...: kv-bench ws3 50% reads, alternating the binaries
R=$1; T=$2; shift 2
for r in $(seq $R); do for b in "$@"; do
  o=$(/var/tmp/s16/$b kv-bench --path /var/tmp/s16/kv.img --workload ws3 --reads 50 --keys 1000000 --ops 2000000 --threads $T 2>/dev/null | grep -o '"ops_per_sec":[0-9]*' | cut -d: -f2)
  echo "$r $b t=$T $o"
done; done
