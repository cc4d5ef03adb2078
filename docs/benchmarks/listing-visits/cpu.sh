#!/bin/bash
# cpu.sh PID CMD...: runs CMD, prints elapsed and PID's user/sys ticks during it
PID=$1; shift
read -r u0 s0 < <(awk '{print $14, $15}' /proc/$PID/stat)
st=$(date +%s.%N); "$@" >/dev/null; en=$(date +%s.%N)
read -r u1 s1 < <(awk '{print $14, $15}' /proc/$PID/stat)
echo "elapsed $(echo "$en - $st" | bc) daemon user $((u1-u0)) sys $((s1-s0)) ticks"
