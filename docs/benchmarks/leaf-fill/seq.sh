#!/bin/bash
# The sequential write and cold read of leaf-fill.md, as root:
#   seq.sh ROUNDS BIN...
# per round and build: a fresh image on a loop device (direct IO, as
# betreefs-bench makes them), a 2 GiB file of random bytes written in 1 MiB
# writes ending with an fsync, the write amplification, the leaves' bytes
# written and the splits (`betreefs stats`), unmount, the leaves and their
# mean size (`fsck` of FSCK=, a build that prints them), then a cold `cat`.
# WORK: a scratch directory (rand2g, 2 GiB of random bytes, is made there).
set -eu
ROUNDS=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
. "$here/loop-image.sh"
for r in $(seq "$ROUNDS"); do
  for B in "$@"; do
    fresh_mount "$B"
    t0=$(date +%s.%N)
    dd if="$work/rand2g" of="$work/mnt/f" bs=1M count=2048 conv=fsync status=none
    t1=$(date +%s.%N)
    wa=$("$B" stats "$work/mnt" | python3 -c "import json,sys; e=json.load(sys.stdin)['engine']; print('%.2f %d %d' % (e['write_amplification'], e['node_bytes_written_per_level'][0]/1e6, e['splits']))")
    unmount
    leaves=$("${FSCK:-$B}" fsck "$dev" 2>&1 | grep -o "[0-9]* of them leaves holding [0-9.]* MiB ([0-9.]* MiB each" || echo "?")
    "$B" mount "$dev" "$work/mnt"
    sync; echo 3 > /proc/sys/vm/drop_caches
    t2=$(date +%s.%N)
    cat "$work/mnt/f" > /dev/null
    t3=$(date +%s.%N)
    unmount
    echo "$(basename "$B") round $r: write $(echo "2147.483648 / ($t1 - $t0)" | bc) MB/s (wa, leaf MB, splits: $wa), read $(echo "2147.483648 / ($t3 - $t2)" | bc) MB/s, $leaves"
  done
done
