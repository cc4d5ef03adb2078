#!/bin/bash
# ab.sh ROUNDS BIN...: toku.sh with each binary in turn, ROUNDS times (builds alternated).
HERE=$(dirname "$0"); ROUNDS=$1; shift
for r in $(seq $ROUNDS); do for b in "$@"; do
  echo -n "$(basename $b): "; B=$b $HERE/toku.sh | tail -1
done; done
