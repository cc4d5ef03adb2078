#!/bin/bash
# kvab.sh ROUNDS BIN...: kv-bench WS3 50% reads, 1M keys, 1M ops, 1 and 2 threads, builds alternated
for r in $(seq $1); do for t in 1 2; do for b in "${@:2}"; do
  o=$($b kv-bench --path ${KV_IMG:-/var/tmp/kv.img} --workload ws3 --reads 50 --keys 1000000 --ops 1000000 --threads $t 2>/dev/null | tail -1)
  echo "$(basename $b) t=$t $(echo $o | python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["ops_per_sec"]))')"
  rm -f ${KV_IMG:-/var/tmp/kv.img}
done; done; done
