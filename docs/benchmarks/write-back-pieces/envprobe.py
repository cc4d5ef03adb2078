import os, sys, time, subprocess
# 4 KiB write + fdatasync in a loop on the host file system while COMMAND
# runs: what a device sync costs beside other writers, no betreefs.
# usage: python3 envprobe.py COMMAND...
p = "envprobe-file"
fd = os.open(p, os.O_CREAT|os.O_RDWR, 0o600)
os.pwrite(fd, os.urandom(1<<20), 0); os.fsync(fd)
cmd = sys.argv[1:]
t0 = time.monotonic()
proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
times=[]; off=0; b=os.urandom(4096)
while proc.poll() is None:
    s=time.monotonic(); os.pwrite(fd,b,off); os.fdatasync(fd); e=time.monotonic()
    times.append((s-t0,e-s)); off=(off+4096)%(1<<20)
lat=sorted(x[1] for x in times); q=lambda f: lat[int(f*len(lat))]*1000
print(f"dur {time.monotonic()-t0:.1f}s n={len(lat)} p50={q(.5):.2f} p99={q(.99):.2f} p999={q(.999):.2f} max={lat[-1]*1000:.1f}")
print([f"{s:.2f}:{l*1000:.0f}" for s,l in times if l>0.008][:40])
