#!/bin/bash
# mvcold.sh BIN ROUNDS: the suite's state before its mv (untar, remount, tar cf of the tree to a pipe),
# then mv of the tree root + sync to a name as long (same) and two bytes longer (longer), alternated
cd /var/tmp/s20; B=$1
rm -f img; truncate -s 8G img; LOOP=$(losetup -f --show --direct-io=on img)
$B mkfs $LOOP --force >/dev/null; $B mount $LOOP mnt
tar xf linux.tar -C mnt; sync; $B umount mnt
T=linux-source-6.1
for r in $(seq $2); do for kind in same longer; do
  $B mount $LOOP mnt; echo 3 > /proc/sys/vm/drop_caches
  tar cf - -C mnt $T | cat > /dev/null
  if [ $kind = same ]; then N=xinux-source-6.1; else N=linux-source-6.1xx; fi
  s=$(date +%s.%N); mv mnt/$T mnt/$N; sync; e=$(date +%s.%N)
  echo "$kind $(echo "($e - $s)*1000" | bc) ms"
  mv mnt/$N mnt/$T; $B umount mnt
done; done
losetup -d $LOOP; rm -f img
