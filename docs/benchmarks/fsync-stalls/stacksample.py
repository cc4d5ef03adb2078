# stacksample.py OUT STOPFILE: every 2 ms until STOPFILE exists, the kernel stack
# (/proc/PID/stack) of each kworker or loop thread that is running or in
# uninterruptible sleep, one line each: time, pid, comm, state, frames.
import os, time, sys
out = open(sys.argv[1], 'w'); stop = sys.argv[2]
while not os.path.exists(stop):
    t = time.time()
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            comm = open(f'/proc/{pid}/comm').read().strip()
            if not comm.startswith('kworker/u') and 'loop' not in comm: continue
            st = open(f'/proc/{pid}/stat').read().split()[2]
            if st not in ('D', 'R'): continue
            stack = open(f'/proc/{pid}/stack').read().split('\n')
            frames = [l.split(' ', 1)[1].split('+')[0] for l in stack if l.strip()]
            out.write(f"{t:.4f} {pid} {comm} {st} {' < '.join(frames[:8])}\n")
        except Exception:
            pass
    time.sleep(0.002)
