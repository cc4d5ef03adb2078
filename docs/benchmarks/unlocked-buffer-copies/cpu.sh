#!/bin/bash
# Build the client first: gcc -O2 -pthread toku.c -o /var/tmp/s11/toku (or set TOKU).
# cpu.sh [nullfuse]: tokubench with the daemon's CPU seconds (user, sys) and context switches
B=${B:-/work/main/target/release/betreefs}
IMG=/var/tmp/s11/t.img; MNT=/tmp/s11-mnt; mkdir -p $MNT; rm -f $IMG
if [ "$1" = nullfuse ]; then $B nullfuse $MNT --foreground $OPTS & DP=$!; else $B mount $IMG $MNT --foreground $OPTS 2>/tmp/s11-daemon.err & DP=$!; fi
for i in $(seq 100); do mountpoint -q $MNT && break; sleep 0.1; done
/usr/bin/time -f "client %U user %S sys" ${TOKU:-/var/tmp/s11/toku} $MNT ${N:-100000}
python3 - $DP <<'PY'
import sys,os,glob
pid=sys.argv[1]; f=open(f"/proc/{pid}/stat").read().split(')')[1].split()
tck=os.sysconf('SC_CLK_TCK'); print(f"daemon user {int(f[11])/tck:.2f} sys {int(f[12])/tck:.2f}")
vol=inv=0
for t in glob.glob(f"/proc/{pid}/task/*/status"):
    for l in open(t):
        if l.startswith('voluntary_ctxt'): vol+=int(l.split()[1])
        if l.startswith('nonvoluntary_ctxt'): inv+=int(l.split()[1])
print("threads", len(glob.glob(f"/proc/{pid}/task/*")), "ctxsw vol", vol, "invol", inv)
PY
umount $MNT; wait
