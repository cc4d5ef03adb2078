#!/bin/bash
# kvlat.sh ROUNDS BIN[:APPLY]...: kv-bench WS3 50% reads, 1M keys, 2M ops, --write-back thread, 1 and 2 threads, builds alternated; ops/s, get and put p99.9/max (ms), engine holds
for r in $(seq $1); do for t in 1 2; do for spec in "${@:2}"; do
  b=${spec%%:*}; a=${spec#*:}; [ "$a" = "$spec" ] && a=writer
  rm -f ${KV_IMG:-./kv.img}
  $b kv-bench --path ${KV_IMG:-./kv.img} --workload ws3 --reads 50 --keys 1000000 --ops 2000000 --threads $t --write-back thread --apply $a --stats 2>/tmp/kvlat.st | tail -1 > /tmp/kvlat.out
  python3 - "$(basename $b):$a" $t <<'PY'
import json, sys
d = json.load(open('/tmp/kvlat.out')); g = d['get_latency']; p = d['put_latency']
t = open('/tmp/kvlat.st').read(); e = json.loads(t[t.find('{'):]); e = e.get('engine', e)
ms = lambda n: round(n / 1e6, 2)
print(sys.argv[1], 't=' + sys.argv[2], round(d['ops_per_sec']), 'get', ms(g['p999_nanos']), ms(g['max_nanos']), 'put', ms(p['p999_nanos']), ms(p['max_nanos']),
      'apply', e['apply_micros_max'], 'step', e['settle_step_micros_max'], 'merge', e['step_merge_micros_max'], 'roomwaits', e.get('staging_room_waits'), e.get('staging_room_wait_micros_max'), 'settled-whole', e.get('roots_settled_in_applications'))
PY
done; done; done; rm -f ${KV_IMG:-./kv.img}
