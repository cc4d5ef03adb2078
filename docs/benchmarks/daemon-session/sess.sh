#!/bin/bash
# sess.sh BIN: by hand, daemonized mount: untar+sync, remount, find (cold), rm -rf + sync
mkdir -p "${WORK:-/var/tmp/daemon-session}"
cd "${WORK:-/var/tmp/daemon-session}"; mkdir -p mnt
B=$1
rm -f img; truncate -s 24G img; LOOP=$(losetup -f --show --direct-io=on img)
$B mkfs $LOOP --force >/dev/null; $B mount $LOOP mnt
PID=$(pgrep -n -f "mount $LOOP")
s=$(date +%s.%N); tar xf "${TARBALL:-/dev/shm/linux.tar}" -C mnt; sync mnt; e=$(date +%s.%N); u=$(echo "$e - $s"|bc)
$B umount mnt; echo 3 > /proc/sys/vm/drop_caches; $B mount $LOOP mnt
s=$(date +%s.%N); find mnt -name wait.c >/dev/null; e=$(date +%s.%N); f=$(echo "$e - $s"|bc)
s=$(date +%s.%N); rm -rf mnt/linux-source-6.1; sync mnt; e=$(date +%s.%N); r=$(echo "$e - $s"|bc)
echo "$(basename $B) untar $u find $f rm $r sid $(awk '{print $6}' /proc/$(pgrep -n -f "mount $LOOP")/stat) mysid $(awk '{print $6}' /proc/$$/stat)"
$B umount mnt; losetup -d $LOOP; rm -f img
