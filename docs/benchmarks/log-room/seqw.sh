#!/bin/bash
# A 2 GiB sequential write (1 MiB writes, then fsync) on a fresh image:
# its time and the daemon's CPU (ticks); the daemon's stats in stats.json.
#   seqw.sh BIN   (WORK: a scratch directory)
WORK=${WORK:-/var/tmp/log-room}
mkdir -p "$WORK"/mnt && cd "$WORK" || exit 1
b=$1
"$b" mkfs --force --size 24G img > /dev/null; chmod 600 img
"$b" mount img mnt
P=$(pgrep -n -f "$(basename "$b") mount img")
head -c 1048576 /dev/urandom > chunk
s=$(date +%s.%N)
python3 -c "
import os
c = open('chunk', 'rb').read()
fd = os.open('mnt/f', os.O_WRONLY | os.O_CREAT, 0o644)
for i in range(2048): os.write(fd, c)
os.fsync(fd); os.close(fd)"
e=$(date +%s.%N)
c=$(cat /proc/"$P"/task/*/stat | awk '{t+=$14+$15} END{print t}')
echo "$(basename "$b") write $(echo "$e - $s" | bc | cut -c1-5) s cpu_ticks $c"
"$b" stats mnt > stats.json
"$b" umount mnt
