# Sourced by the scripts that run in stages (.ci/run, scripts/test.sh):
# `stage NAME CMD...` runs CMD under a heading and appends its wall time to
# $DSP_STAGE_LOG; `stage_table` prints that log as a table. A failing stage
# still records its time (marked FAILED) and fails the caller.
: "${DSP_STAGE_LOG:=$(mktemp)}"
export DSP_STAGE_LOG

stage() {
  local name=$1 t0 rc=0
  shift
  echo "== $name"
  t0=$(date +%s)
  "$@" || rc=$?
  printf '%s\t%d\t%s\n' "$name" $(($(date +%s) - t0)) "$([[ $rc == 0 ]] && echo ok || echo FAILED)" \
    >>"$DSP_STAGE_LOG"
  return $rc
}

stage_table() {
  echo "== stage times"
  awk -F'\t' '{ printf "%-48s %5d s  %s\n", $1, $2, $3; total += $2 }
    END { printf "%-48s %5d s (%d min)\n", "(sum of the stages above)", total, total / 60 }' \
    "$DSP_STAGE_LOG"
}
