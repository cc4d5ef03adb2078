#!/bin/bash
# microtoku.sh BIN TAG: (TOKU: table-share/toku.c built; D: a scratch directory) as the micro suite before its tokubench: a 2 GiB file written and fsynced, read cold, 20,000 random 4 KiB + 4-byte writes + fsync, deleted; then tokubench 100,000 files (timed toku.c)
set -e
BIN=$1; TAG=$2; D=${D:-/var/tmp/s28/mt}; M=$D/mnt; mkdir -p $M
IMG=$D/img; rm -f $IMG; truncate -s 24G $IMG; LOOP=$(losetup -f --show --direct-io=on $IMG)
$BIN mkfs $LOOP --force > /dev/null; $BIN mount $LOOP $M
dd if=/dev/urandom of=$M/seq bs=1M count=2048 conv=fsync status=none
$BIN umount $M; echo 3 > /proc/sys/vm/drop_caches; $BIN mount $LOOP $M
cat $M/seq > /dev/null
# CYCLE=1: the mount cycled again after the read, as the micro suite does before its random writes
if [ -n "$CYCLE" ]; then $BIN umount $M; echo 3 > /proc/sys/vm/drop_caches; $BIN mount $LOOP $M; fi
python3 - $M/seq <<'PY'
import os, random, sys
fd = os.open(sys.argv[1], os.O_WRONLY); blocks = (2 << 30) // 4096; r = random.Random(11)
for size in (4096, 4):
    data = os.urandom(size)
    for _ in range(20000):
        os.pwrite(fd, data, r.randrange(blocks) * 4096)
    os.fsync(fd)
os.close(fd)
PY
rm $M/seq; sync
$BIN stats $M > $D/before-$TAG.json
R=$(${TOKU:-/var/tmp/s28/ts/toku} $M 100000 2)
$BIN stats $M > $D/after-$TAG.json
$BIN umount $M; losetup -d $LOOP; rm -f $IMG
echo "$TAG $R"
python3 - $D/before-$TAG.json $D/after-$TAG.json <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))['engine']; b = json.load(open(sys.argv[2]))
e = b['engine']; f = b['fuse']
print({k: round(v / 1000, 1) for k, v in e.items() if k.endswith('micros_max') and v}, 'daemon longest', f['latency']['max_nanos'] / 1e6, f['latency']['max_opcode'])
print({k: e[k] - a.get(k, 0) for k in ['evictions', 'eviction_steps', 'background_eviction_steps', 'nodes_read', 'leaves_read_for_flushes', 'writes_flushed_log', 'checkpoints', 'work_after_reply', 'settle_steps', 'settles_handed_on'] if k in e})
PY
