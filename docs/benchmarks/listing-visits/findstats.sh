#!/bin/bash
# findstats.sh ROUNDS BIN_A BIN_B: alternated cold find -name wait.c; elapsed, daemon ticks, readdir(plus) handler time per request
cd /var/tmp/s20; LOOP=$(cat loopdev)
for r in $(seq $1); do for B in $2 $3; do
  $B mount $LOOP mnt; echo 3 > /proc/sys/vm/drop_caches
  P=$(pgrep -f "$B mount $LOOP" | head -1)
  $B stats mnt > a.json
  line=$(./cpu.sh $P find mnt -name wait.c)
  $B stats mnt > b.json
  per=$(python3 -c "
import json
a=json.load(open('a.json'))['fuse']; b=json.load(open('b.json'))['fuse']
def d(op,f): return b.get(op,{}).get(f,0)-a.get(op,{}).get(f,0)
print('readdirplus %.1f us x %d, readdir %.1f us x %d' % (d('readdirplus','nanos')/1e3/max(1,d('readdirplus','count')), d('readdirplus','count'), d('readdir','nanos')/1e3/max(1,d('readdir','count')), d('readdir','count')))")
  echo "$(basename $B) $line $per"
  $B umount mnt
done; done
