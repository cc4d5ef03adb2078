#!/bin/bash
# seqab.sh ROUNDS: 2 GiB random-data sequential write (1 MiB writes, fsync), alternating the
# configurations in $CONFIGS ("name:binary:VAR=value"), a fresh 24 GiB image on a loop device each; prints MB/s and the daemon's CPU seconds
W=${WORK:-/var/tmp/purge-near-limit}; mkdir -p $W/mnt; cd $W
# needs /dev/shm/rand2g: head -c 2147483648 /dev/urandom > /dev/shm/rand2g
for r in $(seq $1); do for c in $CONFIGS; do
  IFS=: read name B envs <<<"$c"
  rm -f img; truncate -s 24G img; LOOP=$(losetup -f --show --direct-io=on img)
  $B mkfs $LOOP --force >/dev/null; env $envs $B mount $OPTS $LOOP mnt
  PID=$(pgrep -n -f "mount.*$LOOP")
  t0=$(awk '{print $14+$15}' /proc/$PID/stat)
  s=$(date +%s.%N); dd if=/dev/shm/rand2g of=mnt/f bs=1M conv=fsync status=none; e=$(date +%s.%N)
  t1=$(awk '{print $14+$15}' /proc/$PID/stat)
  echo "$r $name $(echo "2048 / ($e - $s)" | bc) MB/s cpu $(echo "($t1 - $t0)/100" | bc -l | cut -c1-5) s"
  $B umount mnt; losetup -d $LOOP; rm -f img
done; done
