#!/bin/bash
# srcab.sh ROUNDS BIN...: cold mount, then (each cold) find, grep -r, tar cf to a pipe; per build alternated
cd "${WORK:?set WORK to a directory with loop.txt (a loop device holding a betreefs with the kernel tree untarred) and rmnt/}"; LOOP=$(cat loop.txt)
t() { local s=$(date +%s.%N); "$@" > /dev/null 2>&1; local e=$(date +%s.%N); echo "($e - $s)*1000" | bc | cut -c1-7; }
for r in $(seq "$1"); do for b in "${@:2}"; do
  line="$(basename $b)"
  for w in find grep tar; do
    $b mount "$LOOP" rmnt; echo 3 > /proc/sys/vm/drop_caches
    case $w in
      find) ms=$(t find rmnt/linux-source-6.1 -name wait.c);;
      grep) ms=$(t grep -r cpu_to_be64 rmnt/linux-source-6.1);;
      tar) ms=$(t sh -c "tar cf - -C rmnt linux-source-6.1 | cat > /dev/null");;
    esac
    rd=$($b stats rmnt | python3 -c "import json,sys; e=json.load(sys.stdin)['engine']; print(e['device_bytes_read']//1000000, e['nodes_read_ahead'], e['sequential_query_reads'] if 'sequential_query_reads' in e else '-')")
    $b umount rmnt
    line="$line $w $ms ms (MB read, ahead, seq: $rd);"
  done
  echo "$line"
done; done
