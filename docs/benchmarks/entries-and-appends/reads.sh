#!/bin/bash
# reads.sh: on an image holding the kernel tree (made once, by untar of /var/tmp/linux.tar,
# kept in $W/reads.img: make it with the build under test's format), each after a remount
# and drop_caches: find, grep -r, tar cf; wall time and the daemon's time in requests.
. "$(dirname "$0")/common.sh"
IMG=$W/reads.img; MNT=$W/reads-mnt
if [ ! -f $IMG ]; then mount_bt $IMG $MNT; mkdir $MNT/src; (cd $MNT/src && tar xf /var/tmp/linux.tar); umount $MNT; wait $DP; fi
for phase in "find $MNT" "grep -r zzzzqqq $MNT" "tar cf - -C $MNT src"; do
  echo 3 > /proc/sys/vm/drop_caches; mount_bt $IMG $MNT
  s=$(date +%s.%N); eval "$phase" > /dev/null; e=$(date +%s.%N)
  $B stats $MNT > $W/reads-stats.json
  echo "${phase%% *}: $(echo "$e - $s" | bc) s; in requests $(python3 -c "import json; print(round(json.load(open('$W/reads-stats.json'))['fuse']['total']['nanos']/1e9, 3))") s"
  umount $MNT; wait $DP
done
