#!/bin/bash
# tokubench with the daemon's CPU seconds per thread name (user, sys)
B=${B:-/work/main/target/release/betreefs}
IMG=/var/tmp/s11/t.img; MNT=/tmp/s11-mnt; mkdir -p $MNT; rm -f $IMG
$B mount $IMG $MNT --foreground $OPTS 2>/tmp/s11-daemon.err & DP=$!
for i in $(seq 100); do mountpoint -q $MNT && break; sleep 0.1; done
${WORK:-/var/tmp/s11/toku $MNT ${N:-100000}}
python3 - $DP <<'PY'
import sys,os,glob,collections
pid=sys.argv[1]; tck=os.sysconf('SC_CLK_TCK'); agg=collections.defaultdict(lambda:[0,0])
for t in glob.glob(f"/proc/{pid}/task/*"):
    name=open(t+"/comm").read().strip(); f=open(t+"/stat").read().split(')')[1].split()
    agg[name][0]+=int(f[11]); agg[name][1]+=int(f[12])
for k,(u,s) in sorted(agg.items(), key=lambda x:-x[1][0]): print(f"{k:24} user {u/tck:6.2f} sys {s/tck:6.2f}")
PY
umount $MNT; wait
