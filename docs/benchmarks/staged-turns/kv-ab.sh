#!/bin/bash
# kv-bench WS3 50% reads, 1 and 2 threads, two builds: kv-ab.sh OLD NEW (then run again as NEW OLD).
for b in "$1" "$2"; do for t in 1 2; do
  $b kv-bench --path /var/tmp/kvscale/s.img --workload ws3 --reads 50 --keys 1000000 --ops 2000000 --threads $t --stats 2>/tmp/kvs.json > /tmp/kvr.json
  python3 -c "
import json; r=json.loads(open('/tmp/kvr.json').read()); s=json.loads(open('/tmp/kvs.json').readline()); print(json.dumps({'build':'$b','threads':$t,'ops_per_sec':round(r['ops_per_sec']),'apply_micros_max':s['apply_micros_max'],'settle_step_micros_max':s['settle_step_micros_max'],'checkpoint_image_micros_max':s['checkpoint_image_micros_max'],'staged_application_turns':s.get('staged_application_turns')}))"
done; done
