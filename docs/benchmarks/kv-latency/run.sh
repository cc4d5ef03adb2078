#!/bin/bash
# run.sh ROUNDS OUT BUILD[:FLAGS]...: kv-bench WS3 (50% reads, 1M keys, 2M ops) with 1 and 2
# client threads, alternating the builds round by round; one JSON line per run in OUT
# (the report, with the build, its flags and the engine's counters under "engine").
R=$1; OUT=$2; shift 2
for r in $(seq "$R"); do for t in 1 2; do for spec in "$@"; do
  b=${spec%%:*}; flags=""; [ "$spec" != "$b" ] && flags=${spec#*:}
  # shellcheck disable=SC2086
  "$b" kv-bench --path "${KV_IMG:-/var/tmp/kv-latency.img}" --workload ws3 --reads 50 \
      --keys 1000000 --ops 2000000 --threads "$t" --stats $flags 2> /tmp/kv-latency.err |
    python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d['build']='$(basename "$b")'; d['flags']='$flags'; d['round']=$r; d['engine']=json.loads(open('/tmp/kv-latency.err').read().strip().splitlines()[-1]); print(json.dumps(d))" >> "$OUT"
done; done; done
