#!/bin/bash
# kv.sh ROUNDS READS THREADS BUILD...: kv-bench WS3 (READS% reads) on a fresh image per run, the
# builds alternated round by round: puts only (READS=0, 300,000 keys, 1M ops) or the issue's mix
# (READS=50, 1M keys, 2M ops); ops/s, the process's CPU (user+system), get and put p99.9 / longest.
R=$1; READS=$2; T=$3; shift 3; IMG=${KV_IMG:-/var/tmp/staged-once-kv.img}
if [ "$READS" = 0 ]; then KEYS=300000; OPS=1000000; else KEYS=1000000; OPS=2000000; fi
for r in $(seq "$R"); do for b in "$@"; do
  rm -f "$IMG"
  /usr/bin/time -f "%U+%S" -o /tmp/staged-once-time "$b" kv-bench --path "$IMG" --workload ws3 \
      --reads "$READS" --keys $KEYS --ops $OPS --threads "$T" 2>/dev/null > /tmp/staged-once.json
  python3 - "$r" "$(basename "$b")" <<'PY'
import json, sys
d = json.load(open('/tmp/staged-once.json')); g = d['get_latency']; p = d['put_latency']
us = lambda h, k: h[k] // 1000 if h and h['count'] else '-'
print(sys.argv[1], sys.argv[2], round(d['ops_per_sec']), 'cpu', open('/tmp/staged-once-time').read().strip(),
      'get p99.9/max us', us(g, 'p999_nanos'), us(g, 'max_nanos'), 'put', us(p, 'p999_nanos'), us(p, 'max_nanos'))
PY
done; done; rm -f "$IMG"
