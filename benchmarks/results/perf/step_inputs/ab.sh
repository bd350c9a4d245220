# Old and new code in alternating processes, the order flipped from pair to pair.
# usage: ab.sh OLD_CHECKOUT NEW_CHECKOUT PAIRS BATCH [stream]   (e.g. git worktree add /tmp/old_wt b07ed66)
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python}
for i in $(seq 1 $3); do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for w in $order; do
    if [ $w = old ]; then d=$1; else d=$2; fi
    echo -n "$w "; (cd "$d" && PYTHONPATH="$d" $py "$here/phases.py" $4 $5 2>/dev/null | tr '\n' ' '); echo
  done
done
