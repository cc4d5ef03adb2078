#!/bin/bash
# rmrf2.sh BIN TAG [perf]: untar, warm dentries with tar cf, then rm -rf + sync timed (as the bench)
set -e
BIN=$1; TAG=$2; D=${WORK:-/var/tmp/after-reply}/rm; mkdir -p $D
IMG=$D/img; MNT=$D/mnt; mkdir -p $MNT
rm -f $IMG; truncate -s 8G $IMG; chmod 600 $IMG
if [ "$BIN" = nullfuse ]; then ${NULLFUSE_BIN:-./target/release/betreefs} nullfuse $MNT & sleep 1; else
$BIN mkfs $IMG --force >/dev/null; $BIN mount $IMG $MNT; fi
tar xf /dev/shm/linux.tar -C $MNT; sync
tar cf - -C $MNT . | cat > /dev/null
[ "$BIN" != nullfuse ] && $BIN stats $MNT > $D/before-$TAG.json
if [ -n "$3" ]; then perf record -F 999 -a -g -o $D/perf-$TAG.data -- sleep 4 > /dev/null 2>&1 & sleep 0.3; fi
s=$(date +%s.%N); rm -rf $MNT/*; sync; e=$(date +%s.%N)
echo "$TAG rm -rf + sync: $(echo "$e - $s" | bc) s"
wait
if [ "$BIN" != nullfuse ]; then $BIN stats $MNT > $D/after-$TAG.json; $BIN umount $MNT; else umount $MNT; fi
