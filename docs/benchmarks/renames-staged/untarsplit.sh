#!/bin/bash
# untarsplit.sh ROUNDS BIN...: the kernel tree (WORK/src.tar) untarred and then synced, the two timed apart, on a fresh mount per build, alternated ("nullfuse" runs it on nullfuse); the daemon CPU and its threads'
cd "${WORK:?set WORK}"; mkdir -p umnt
REAL=$(for b in "${@:2}"; do [ "$b" != nullfuse ] && echo $b && break; done)
for r in $(seq "$1"); do for b in "${@:2}"; do
  if [ "$b" = nullfuse ]; then
    $REAL nullfuse umnt & sleep 1; P=$(pgrep -n -f "$(basename $REAL) nullfuse umnt")
  else
    rm -f uimg; truncate -s 16G uimg; L=$(losetup -f --show --direct-io=on uimg)
    $b mkfs $L --force > /dev/null; $b mount $L umnt; P=$(pgrep -n -f "$(basename $b) mount $L")
  fi
  read -r u0 s0 < <(awk '{print $14, $15}' /proc/$P/stat)
  t0=$(date +%s.%N); tar xf src.tar -C umnt; t1=$(date +%s.%N); sync -f umnt; t2=$(date +%s.%N)
  read -r u1 s1 < <(awk '{print $14, $15}' /proc/$P/stat)
  TH=$(for t in /proc/$P/task/*; do echo "$(cat $t/comm | cut -c1-14):$(awk '{print ($14+$15)*10}' $t/stat)"; done | awk -F: '{a[$1]+=$2} END {for (k in a) if (a[k] >= 100) printf "%s=%d ", k, a[k]}')
  if [ "$b" = nullfuse ]; then fusermount3 -u umnt; wait; else $b umount umnt; losetup -d $L; rm -f uimg; fi
  echo "$(basename $b) tar $(echo "$t1 - $t0" | bc) sync $(echo "$t2 - $t1" | bc) | daemon user $(( (u1-u0)*10 )) sys $(( (s1-s0)*10 )) ms | $TH"
done; done
