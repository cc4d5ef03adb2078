#!/bin/bash
# Alternated kv-bench runs of builds, one and two client threads (and
# more with THREADS), WS3 with 50% reads over 1M keys.
#   ab.sh ROUNDS OPS WORKDIR BIN... ; THREADS="1 2 4" to add four threads
# Prints "BIN THREADS OPS_PER_SEC" per run.
set -e
R=$1; OPS=$2; W=$3; shift 3
mkdir -p "$W"
for r in $(seq "$R"); do for b in "$@"; do for t in ${THREADS:-1 2}; do
  x=$("$b" kv-bench --path "$W/kv.img" --workload ws3 --reads 50 --keys 1000000 \
        --ops "$OPS" --threads "$t" 2>/dev/null | grep -o '"ops_per_sec":[0-9]*' | cut -d: -f2)
  echo "$(basename "$b") $t $x"
done; done; done
rm -f "$W/kv.img"
