#!/bin/bash
# run2.sh BIN TAG FILES: tokubench by hand (FILES 200-byte files, 2 processes, 128 per directory, then syncfs) on a fresh default mount; then files/s, the daemon's peak resident size, the inode table, entries released/forgotten, the longest request
BIN=$1; TAG=$2; N=${3:-400000}; D=${D:-/var/tmp/table-share}; M=$D/mnt; mkdir -p $M
IMG=$D/img; rm -f $IMG; truncate -s 16G $IMG; LOOP=$(losetup -f --show --direct-io=on $IMG)
$BIN mkfs $LOOP --force > /dev/null; $BIN mount $LOOP $M
P=$(pgrep -n -f "$(basename $BIN) mount $LOOP"); if [ -n "$RENICE" ]; then for t in /proc/$P/task/*; do renice -n $RENICE -p ${t##*/} >/dev/null; done; fi
R=$($D/toku $M $N 2)
HWM=$(awk '/VmHWM/{print int($2/1024)}' /proc/$P/status)
$BIN stats $M > $D/stats-$TAG.json
S=$(python3 - $D/stats-$TAG.json <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); e = s['engine']; f = s['fuse']
print({k.replace('_micros_max',''):round(v/1000,1) for k,v in e.items() if k.endswith('micros_max') and 'io' not in k and v}, 'table', e['memory_beside_cache_bytes'] >> 20, 'MiB released', f.get('released_entries', '-'), 'forgotten', f['forgotten_inodes'], 'cache_budget', e['cache_budget_bytes'] >> 20, 'MiB longest', round(f['latency']['max_nanos'] / 1e6, 1), 'ms', f['latency']['max_opcode'])
PY
)
$BIN umount $M; losetup -d $LOOP; rm -f $IMG
echo "$TAG $R | peak $HWM MiB | $S"
