#!/bin/bash
# srcrm.sh ROUNDS BIN...: kernel source untarred, remounted with caches dropped, then rm -rf + sync timed; alternated
# WORK holds src.tar (xz -dc /usr/src/linux-source-6.1.tar.xz > src.tar), an empty
# directory rmnt, and loop.txt: the path of a loop device over a 16 GiB image
# (truncate -s 16G img; losetup -f --show --direct-io=on img > loop.txt).
cd "${WORK:-/var/tmp/rmdir-counted}" || exit 1
LOOP=$(cat loop.txt)
for r in $(seq "$1"); do for b in "${@:2}"; do
  "$b" mkfs "$LOOP" --force > /dev/null; "$b" mount "$LOOP" rmnt
  tar xf src.tar -C rmnt; "$b" umount rmnt; echo 3 > /proc/sys/vm/drop_caches; "$b" mount "$LOOP" rmnt
  s=$(date +%s.%N); rm -rf rmnt/linux-source-6.1; sync; e=$(date +%s.%N)
  echo "$(basename "$b") rm -rf $(echo "$e - $s" | bc)"
  "$b" umount rmnt
done; done
