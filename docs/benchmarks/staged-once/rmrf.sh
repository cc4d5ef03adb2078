#!/bin/bash
# rmrf.sh BIN TAG [perf]: a tree of 60,000 files (300 dirs x 200 files, 100-8000 bytes) made on a fresh mount (or nullfuse when BIN is "null:BIN"), mount cycled, caches dropped, then rm -rf timed; daemon CPU during rm
SPEC=$1; TAG=$2; D=${D:-/var/tmp/staged-once-rm}; M=$D/mnt; mkdir -p $M
mk() { python3 - $M <<'PY'
import os, sys, random
r = random.Random(5); root = sys.argv[1] + '/t'
for d in range(300):
    p = f'{root}/d{d // 30}/e{d}'; os.makedirs(p, exist_ok=True)
    for f in range(200):
        with open(f'{p}/f{f}', 'wb') as fh: fh.write(b'x' * r.randrange(100, 8000))
PY
}
if [ "${SPEC%%:*}" = null ]; then
  BIN=${SPEC#null:}; $BIN nullfuse $M; P=$(pgrep -n -f "$(basename $BIN) mount nullfuse $M"); mk
else
  BIN=$SPEC; IMG=$D/img; rm -f $IMG; truncate -s 16G $IMG; LOOP=$(losetup -f --show --direct-io=on $IMG)
  $BIN mkfs $LOOP --force > /dev/null; $BIN mount $LOOP $M; mk; sync
  $BIN umount $M; echo 3 > /proc/sys/vm/drop_caches; $BIN mount $LOOP $M
  P=$(pgrep -n -f "$(basename $BIN) mount $LOOP")
fi
cpu() { awk '{print $14+$15}' /proc/$P/stat; }
[ "$3" = perf ] && { perf record -F 2000 --call-graph dwarf,32768 -o $D/perf-$TAG.data -p $P 2>/dev/null & PP=$!; sleep 1; }
C0=$(cpu); S=$(date +%s.%N); rm -rf $M/t; E=$(date +%s.%N); C1=$(cpu)
[ -n "$PP" ] && { kill -INT $PP; wait $PP; }
if [ "${SPEC%%:*}" = null ]; then fusermount3 -u $M; else $BIN stats $M > $D/stats-$TAG.json; $BIN umount $M; losetup -d $LOOP; rm -f $IMG; fi
T=$(getconf CLK_TCK)
echo "$TAG rm -rf $(echo "$E - $S" | bc) s, daemon cpu $(echo "scale=2; ($C1-$C0)/$T" | bc) s"
