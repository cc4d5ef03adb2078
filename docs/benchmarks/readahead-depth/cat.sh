#!/bin/bash
# The hand-runs of readahead-depth.md, as root: one image on a loop device
# (direct IO, as betreefs-bench makes them) holding one 2 GiB file, then
# cold `cat` of it, the build before and the build after alternated:
# OLD= the betreefs binary before (2489b97), NEW= after (default: this
# checkout's). One line per run: build, seconds, MB/s.
set -eu
NEW=${NEW:-$(pwd)/target/release/betreefs}
OLD=${OLD:?the binary before}
ROUNDS=${ROUNDS:-4}
work=${WORK:-/var/tmp/readahead-depth}
mkdir -p "$work/mnt"
img=$work/ra.img
rm -f "$img"
truncate -s 8G "$img"
dev=$(losetup -f --show --direct-io=on "$img")
# umount returns before the daemon has checkpointed and let the device go.
unmount() {
  umount "$work/mnt"
  while pgrep -f "mount $dev $work/mnt" > /dev/null; do sleep 0.1; done
}
cleanup() {
  if mountpoint -q "$work/mnt"; then unmount; fi
  losetup -d "$dev"
  rm -f "$img"
}
trap cleanup EXIT
"$NEW" mkfs --force "$dev" > /dev/null
"$NEW" mount "$dev" "$work/mnt"
dd if=/dev/urandom of="$work/mnt/f" bs=1M count=2048 status=none
unmount
for r in $(seq "$ROUNDS"); do
  for v in old new; do
    B=$NEW; [ $v = old ] && B=$OLD
    "$B" mount "$dev" "$work/mnt"
    sync; echo 3 > /proc/sys/vm/drop_caches
    t0=$(date +%s.%N)
    cat "$work/mnt/f" > /dev/null
    t1=$(date +%s.%N)
    unmount
    echo "$v round $r: $(echo "$t1 - $t0" | bc) s, $(echo "2048 * 1.048576 / ($t1 - $t0)" | bc) MB/s"
  done
done
