#!/bin/bash
# ab.sh ROUNDS OLD NEW SCRIPT...: runs each script with B=OLD then B=NEW, ROUNDS times,
# alternating, labelling each output.
rounds=$1 old=$2 new=$3; shift 3
for r in $(seq $rounds); do for s in "$@"; do for b in $old $new; do
  echo "== $(basename $s) $(basename $b) round $r"; B=$b bash $s
done; done; done
