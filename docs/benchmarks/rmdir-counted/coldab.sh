#!/bin/bash
# coldab.sh ROUNDS BIN...: one untarred kernel tree; per binary, alternated: remount cold, find; remount cold, tar cf to a pipe
# WORK holds src.tar (xz -dc /usr/src/linux-source-6.1.tar.xz > src.tar), an empty
# directory rmnt, and loop.txt: the path of a loop device over a 16 GiB image
# (truncate -s 16G img; losetup -f --show --direct-io=on img > loop.txt).
cd "${WORK:-/var/tmp/rmdir-counted}" || exit 1
LOOP=$(cat loop.txt); B0=$2
$B0 mkfs "$LOOP" --force > /dev/null; $B0 mount "$LOOP" rmnt; tar xf src.tar -C rmnt; $B0 umount rmnt
for r in $(seq "$1"); do for b in "${@:2}"; do
  echo 3 > /proc/sys/vm/drop_caches; $b mount "$LOOP" rmnt
  s=$(date +%s.%N); find rmnt -name wait.c > /dev/null; e=$(date +%s.%N); f=$(echo "$e - $s" | bc)
  $b umount rmnt; echo 3 > /proc/sys/vm/drop_caches; $b mount "$LOOP" rmnt
  s=$(date +%s.%N); tar cf - -C rmnt linux-source-6.1 | cat > /dev/null; e=$(date +%s.%N); t=$(echo "$e - $s" | bc)
  $b umount rmnt
  echo "$(basename $b) find $f tar $t"
done; done
