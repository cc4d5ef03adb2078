#!/bin/bash
# toku.sh: tokubench (../table-lock/toku.c: 200-byte files, 128 per directory, NT=2 threads, N files) on a
# fresh image; files/s, the daemon's CPU, the longest request.
. "$(dirname "$0")/common.sh"
[ -x $W/toku ] || cc -O2 -pthread -o $W/toku $HERE/../table-lock/toku.c
IMG=$W/toku.img; MNT=$W/toku-mnt; rm -f $IMG
mount_bt $IMG $MNT; c0=($(daemon_cpu))
NT=${NT:-2} $W/toku $MNT ${N:-200000} | tail -1 | tr '\n' ';'
c1=($(daemon_cpu)); $B stats $MNT > $W/toku-stats.json
echo " daemon user $((c1[0]-c0[0])) sys $((c1[1]-c0[1])) ticks"
python3 -c "
import json; d=json.load(open('$W/toku-stats.json'))['fuse']
print('longest request %.2f ms (%s)' % (d['latency']['max_nanos']/1e6, d['latency']['max_opcode']))
for op in ('create','write'): print('%s %.2f us' % (op, d[op]['nanos']/d[op]['count']/1000))"
umount $MNT; wait $DP; rm -f $IMG
