#!/bin/bash
# wbab.sh ROUNDS BIN...: betreefs-bench's source suite (one round, betreefs alone) for each
# build, alternated; prints untar, the write + fsync rows and the daemon's peak.
# BENCH: the betreefs-bench binary (default target/release/betreefs-bench of this checkout);
# WORK: a scratch directory (default /var/tmp/wbab).
BENCH=${BENCH:-$(cd "$(dirname "$0")/../../.." && pwd)/target/release/betreefs-bench}
WORK=${WORK:-/var/tmp/wbab}
for r in $(seq "$1"); do for b in "${@:2}"; do
  d=$WORK/$(basename $b)-$r; rm -rf $d; mkdir -p $d/out $d/work
  $BENCH --fs betreefs --betreefs $b --suite source --scale default --rounds 1 --out $d/out --workdir $d/work > $d/log.txt 2>&1
  python3 - $d/out/results.json $(basename $b) <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); v={r['name']:r['values']['betreefs'][0] for r in d['results']['rows'] if 'betreefs' in r['values']}
print(sys.argv[2], 'untar %.2f'%v['untar + sync'], 'p99.9 %.2f'%v['4 KiB write + fsync during untar: p99.9'], 'max %.1f'%v['4 KiB write + fsync during untar: max'], 'own %.1f'%v['4 KiB write + fsync during untar: max, device stalls taken out'], 'stall %.1f'%v['source: write + fsync during untar: longest stall'], 'peak %.0f'%v.get('source suite: daemon peak resident',0))
PY
done; done
