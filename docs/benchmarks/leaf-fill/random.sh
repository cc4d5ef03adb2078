#!/bin/bash
# The random writes of leaf-fill.md, as root:  random.sh ROUNDS BIN...
# per round and build: a 2 GiB file written as in seq.sh, unmount, mount,
# page cache dropped, then 20,000 random block-aligned 4 KiB writes and
# 20,000 4-byte ones, each phase ending with an fsync (random.py, ops/s),
# and what the daemon read and wrote meanwhile. WORK as in seq.sh.
set -eu
ROUNDS=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
. "$here/loop-image.sh"
for r in $(seq "$ROUNDS"); do
  for B in "$@"; do
    fresh_mount "$B"
    dd if="$work/rand2g" of="$work/mnt/f" bs=1M count=2048 conv=fsync status=none
    unmount
    "$B" mount "$dev" "$work/mnt"; sync; echo 3 > /proc/sys/vm/drop_caches
    out=$(python3 "$here/random.py" "$work/mnt/f" 20000 4096 11; python3 "$here/random.py" "$work/mnt/f" 20000 4 12)
    s=$("$B" stats "$work/mnt" | python3 -c "
import json,sys; e=json.load(sys.stdin)['engine']
print('read MB %d, written MB %d, leaf MB read %d, flushes %d' % (e['device_bytes_read']/1e6, e['device_bytes_written']/1e6, e['node_bytes_read_per_level'][0]/1e6, e['flushes']))")
    unmount
    echo "$(basename "$B") round $r: ops/s 4 KiB, 4 bytes: $out | $s"
  done
done
