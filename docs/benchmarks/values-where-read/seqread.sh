#!/bin/bash
# Cold sequential read of a 2 GiB file through a betreefs mount, for each
# binary given, ROUNDS times alternated: dd's throughput and the mount
# daemon's user and system CPU ticks during the read.
#   seqread.sh ROUNDS BIN...
# The image (8 GiB, on a loop device with direct IO) is written once by
# the first binary and mounted by each in turn; caches are dropped
# before every read. Run as root; writes under $WORK (/var/tmp/seqread).
set -euo pipefail
ROUNDS=$1; shift
WORK=${WORK:-/var/tmp/seqread}
MNT=$WORK/mnt; IMG=$WORK/img
mkdir -p "$MNT"
rm -f "$IMG"; truncate -s 8G "$IMG"
LOOP=$(losetup -f --show --direct-io=on "$IMG")
trap 'mountpoint -q "$MNT" && umount "$MNT"; losetup -d "$LOOP"' EXIT
"$1" mkfs "$LOOP" --force > /dev/null
"$1" mount "$LOOP" "$MNT"
dd if=/dev/urandom of="$MNT/big" bs=1M count=2048 conv=fsync status=none
"$1" umount "$MNT"
for round in $(seq "$ROUNDS"); do
  for bin in "$@"; do
    "$bin" mount "$LOOP" "$MNT" --foreground 2>/dev/null & daemon=$!
    for _ in $(seq 100); do mountpoint -q "$MNT" && break; sleep 0.1; done
    sync; echo 3 > /proc/sys/vm/drop_caches
    c0=($(awk '{print $14, $15}' /proc/$daemon/stat))
    rate=$(dd if="$MNT/big" of=/dev/null bs=1M 2>&1 | tail -1 | sed 's/.*copied, //')
    c1=($(awk '{print $14, $15}' /proc/$daemon/stat))
    echo "round $round $(basename "$bin"): $rate, daemon user $((c1[0]-c0[0])) sys $((c1[1]-c0[1])) ticks"
    "$bin" umount "$MNT"; wait $daemon || true
  done
done
