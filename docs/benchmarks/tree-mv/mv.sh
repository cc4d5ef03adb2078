#!/bin/bash
# mv of a source tree's root, for each binary given, ROUNDS times
# alternated: the kernel tree (/var/tmp/linux.tar) is untarred once by the
# first binary; each turn mounts a binary, reads the tree cold (tar cf to
# a pipe, as the benchmark's source suite does before its mv), then times
# six renames of the tree's root back and forth (src to moved, whose keys
# grow by two bytes and are checked against the key limit, as the
# benchmark's mv; moved to src, which shrink them and are not), each
# followed by a sync.
#   mv.sh ROUNDS BIN...
# Run as root; writes under $WORK (/var/tmp/tree-mv).
set -euo pipefail
ROUNDS=$1; shift
WORK=${WORK:-/var/tmp/tree-mv}
MNT=$WORK/mnt; IMG=$WORK/img
mkdir -p "$MNT"; rm -f "$IMG"
"$1" mount "$IMG" "$MNT"
mkdir "$MNT/src"; (cd "$MNT/src" && tar xf /var/tmp/linux.tar)
"$1" umount "$MNT"
for round in $(seq "$ROUNDS"); do
  for bin in "$@"; do
    sync; echo 3 > /proc/sys/vm/drop_caches
    "$bin" mount "$IMG" "$MNT"
    tar cf - -C "$MNT" src | cat > /dev/null
    sync -f "$MNT"
    times=""
    for i in 1 2 3; do
      for pair in "src moved" "moved src"; do
        read -r from to <<< "$pair"
        t0=$(date +%s%N); mv "$MNT/$from" "$MNT/$to"; t1=$(date +%s%N); sync -f "$MNT"
        times="$times $(( (t1 - t0) / 1000 ))"
      done
    done
    echo "round $round $(basename "$bin"): mv in microseconds:$times"
    "$bin" umount "$MNT"
  done
done
rm -f "$IMG"
