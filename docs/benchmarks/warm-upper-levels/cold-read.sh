#!/bin/bash
# cold single-read measurement: betreefs on a loop device
set -e
B=${B:-/work/main/target/release/betreefs}
IMG=${WORK:-/var/tmp/warm-cold}/img; MNT=${WORK:-/var/tmp/warm-cold}/mnt
mkdir -p $MNT
if [ "$SETUP" = 1 ]; then
  rm -f $IMG; truncate -s 4G $IMG
  LOOP=$(losetup -f --show --direct-io=on $IMG); echo $LOOP > loopdev
  $B mkfs $LOOP --force >/dev/null
  $B mount $LOOP $MNT
  mkdir -p $MNT/bench/small
  head -c 100000000 /dev/urandom > $MNT/bench/readable
  for i in $(seq 1 1000); do head -c 1024 /dev/urandom > $MNT/bench/small/f$i; done
  sync
  $B umount $MNT
fi
LOOP=$(cat loopdev)
dev=$(basename $LOOP)
for i in 1 2 3 4 5; do
  $B mount $LOOP $MNT
  r0=$(awk '{print $3}' /sys/block/$dev/stat)
  python3 -c "
import os,random
random.seed($i)
fd=os.open('$MNT/bench/readable',os.O_RDONLY)
os.pread(fd,4096,random.randrange(0,100000000//4096)*4096)
"
  r1=$(awk '{print $3}' /sys/block/$dev/stat)
  echo "read sectors: $((r1-r0)) = $(( (r1-r0)*512/4096 ))x"
  $B stats $MNT > stats.$i.json
  $B umount $MNT
done
