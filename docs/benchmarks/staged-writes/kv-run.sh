#!/bin/bash
# kv-bench WS3 50% reads, staging off/on, 1 and 2 threads, alternated rounds.
B=${B:-/var/tmp/kvstage/b-stage}
for r in 1 2; do
  for s in ${SIZES:-0 256 1024}; do
    for t in ${THREADS:-1 2}; do
      $B kv-bench --path /var/tmp/kvscale/s.img --workload ws3 --reads 50 --keys 1000000 --ops 2000000 --threads $t --staged-kb $s --stats 2>/tmp/kvstage-stats.json |
        python3 -c "import json,sys; r=json.loads(sys.stdin.read()); s=json.loads(open('/tmp/kvstage-stats.json').readline()); print(json.dumps({'round':$r,'staged_kb':$s,'threads':$t,'ops_per_sec':round(r['ops_per_sec']),'nodes_read':s['nodes_read'],'staged_applications':s.get('staged_applications'),'apply_micros_max':s['apply_micros_max']}))"
    done
  done
done
