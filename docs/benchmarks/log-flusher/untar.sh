#!/bin/bash
# untar.sh: B=binary OPTS=mount options; times untar + sync of /var/tmp/linux.tar on a
# fresh image (no fsync beside it), then prints the engine's longest step, the writes that
# wrote the log themselves and the longest FUSE request.
IMG=/var/tmp/untar.img; MNT=/tmp/untar-mnt; mkdir -p $MNT; rm -f $IMG
$B mount $IMG $MNT ${OPTS:+-o $OPTS} || exit 1
mkdir $MNT/src
s=$(date +%s.%N); (cd $MNT/src && tar xf /var/tmp/linux.tar); sync -f $MNT; e=$(date +%s.%N)
echo "untar+sync $(echo "$e - $s" | bc) s"
$B stats $MNT > /tmp/untar-stats.json
python3 -c "
import json; s=json.load(open('/tmp/untar-stats.json'))
def f(d,pre=''):
    for k,v in d.items():
        if isinstance(v,dict): f(v,pre+k+'.')
        elif k in ('writes_flushed_log','settle_step_micros_max','flush_turn_micros_max','writes_waited_for_flush','flush_wait_micros_max') or (pre.startswith('fuse') and 'max' in k): print(' ', pre+k, v)
f(s)"
$B umount $MNT; rm -f $IMG
