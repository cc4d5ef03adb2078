#!/bin/bash
# rm.sh: untar the kernel tree (/var/tmp/linux.tar), remount, tar cf it (cold), mv it,
# then time rm -rf (and the sync after); the daemon's CPU and per-request time of the rm.
. "$(dirname "$0")/common.sh"
IMG=$W/rm.img; MNT=$W/rm-mnt; rm -f $IMG
mount_bt $IMG $MNT; mkdir $MNT/src; (cd $MNT/src && tar xf /var/tmp/linux.tar); umount $MNT; wait $DP
echo 3 > /proc/sys/vm/drop_caches; mount_bt $IMG $MNT
tar cf - -C $MNT src | cat > /dev/null
mv $MNT/src $MNT/moved; sync -f $MNT
$B stats $MNT > $W/rm-before.json; c0=($(daemon_cpu))
t0=$(date +%s.%N); rm -rf $MNT/moved; tm=$(date +%s.%N); sync -f $MNT; t1=$(date +%s.%N)
c1=($(daemon_cpu)); $B stats $MNT > $W/rm-after.json
echo "rm -rf $(echo "$tm - $t0" | bc) s, sync $(echo "$t1 - $tm" | bc) s; daemon user $((c1[0]-c0[0])) sys $((c1[1]-c0[1])) ticks"
python3 $HERE/opdiff.py $W/rm-before.json $W/rm-after.json | grep -E "^(unlink|rmdir|total) "
umount $MNT; wait $DP; rm -f $IMG
