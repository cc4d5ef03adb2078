#!/bin/bash
# rw.sh BIN TAG: a 768 MiB file written, then 4 MiB random overwrites with an fsync every 8: daemon VmHWM and wait stats
BIN=$1; TAG=$2; D=${D:-/var/tmp/checkpoint-copies}
IMG=$D/rw-$TAG.img; M=$D/mnt-$TAG; mkdir -p $M
rm -f $IMG; truncate -s 6G $IMG
LOOP=$(losetup -f --show --direct-io=on $IMG)
$BIN mkfs $LOOP --force >/dev/null
$BIN mount $LOOP $M
P=$(pgrep -n -f "$(basename $BIN) mount $LOOP")
python3 - $M <<'PY'
import os, sys, random
m = sys.argv[1]; f = os.path.join(m, 'big'); chunk = os.urandom(4 << 20)
fd = os.open(f, os.O_CREAT | os.O_WRONLY, 0o644)
for i in range(192): os.pwrite(fd, chunk, i << 22)
os.fsync(fd)
rnd = random.Random(7)
for i in range(600):
    os.pwrite(fd, chunk[i % 4096:] + chunk[:i % 4096], rnd.randrange(192) << 22)
    if i % 8 == 7: os.fsync(fd)
os.fsync(fd); os.close(fd)
PY
HWM=$(awk '/VmHWM/{print int($2/1024)}' /proc/$P/status)
S=$($BIN stats $M | python3 -c 'import json,sys; e=json.load(sys.stdin)["engine"]; print("waits",e.get("checkpoint_copies_waits"),"wmax_us",e.get("checkpoint_copies_wait_micros_max"),"wtot_us",e.get("checkpoint_copies_wait_micros_total"),"ckpts",e.get("checkpoints"),"evict",e.get("evict_micros_max"))')
$BIN umount $M; losetup -d $LOOP; rm -f $IMG
echo "$TAG hwm $HWM $S"
