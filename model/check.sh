#!/usr/bin/env bash
# Checks the Promela model of kvfuse's load and save protocol (model/load_protocol.pml,
# docs/model.md) with spin: spin -a writes the verifier pan.c, cc builds it (-DSAFETY: the
# properties are assertions and end states, so no cycle search), pan searches every state.
#
#   model/check.sh                       every size below: exit 0 only if each search is
#                                        complete and finds no error
#   model/check.sh --control             the stranded-load bug put back (STRANDED_BUG):
#                                        exit 0 only if spin finds a request left parked,
#                                        and writes a trail, which is printed
#   model/check.sh --expect-violation -DNAME...
#                                        a variant that must fail (docs/model.md lists them):
#                                        exit 0 only if spin finds an error; prints the trail
#   model/check.sh --coverage            every place marked COVER(n) in the model is reached
#                                        (n listed in COVERED below), so no property holds
#                                        only because its path was never taken
#   --work DIR                           keep spin's files (pan.c, the trail) in DIR
#
# The sizes run one after the other (KVFUSE_MODEL_JOBS=2 runs two at once); each search
# stays under 2 GiB (-DMEMLIM) and is complete, or the check fails.
#
# Needs spin (Debian package spin, installed by scripts/deps.sh) and a C compiler; SPIN and
# CC name them otherwise. Exit status: 0 as above, 1 a property or an expectation failed,
# 2 a usage error or a missing tool.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
model=$here/load_protocol.pml
spin=${SPIN:-spin}
cc=${CC:-cc}

# The sizes the properties are checked at: a name and the spin flags. The two requests are
# always there; NR ranks, NG keys (loads and saves), NA admissions, MAXCRASH rank deaths,
# MAXREST returns. docs/model.md has the state counts.
SIZES=(
  "2 ranks, 2 admissions, 3 keys, 2 deaths, 1 return|-DNR=2 -DNG=3 -DNA=2 -DMAXCRASH=2 -DMAXREST=1"
  "2 ranks, 3 admissions, 2 keys, 2 deaths, 1 return|-DNR=2 -DNG=2 -DNA=3 -DMAXCRASH=2 -DMAXREST=1"
  "3 ranks, 2 admissions, 2 keys, 2 deaths|-DNR=3 -DNG=2 -DNA=2 -DMAXCRASH=2 -DMAXREST=0"
  "3 ranks, 2 admissions, 1 key, 3 deaths, 1 return|-DNR=3 -DNG=1 -DNA=2 -DMAXCRASH=3 -DMAXREST=1"
)
# The control and the variants run at the first size.
FIRST="-DNR=2 -DNG=3 -DNA=2 -DMAXCRASH=2 -DMAXREST=1"
# The COVER(n) places every size-1 search must be able to reach (19, a late save record,
# cannot happen here: docs/model.md).
COVERED="1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 20 21"

# usage STATUS: the comment above, on stdout for --help, on stderr for a usage error.
usage() {
  if [ "$1" -eq 0 ]; then help_to=/dev/stdout; else help_to=/dev/stderr; fi
  sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//' > "$help_to"
  exit "$1"
}

mode=properties
work=""
jobs=${KVFUSE_MODEL_JOBS:-1}
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --control) mode=control ;;
    --coverage) mode=coverage ;;
    --expect-violation) mode=violation ;;
    --work) shift; [ $# -gt 0 ] || usage 2; work=$1 ;;
    -D*) [ "$mode" = violation ] || usage 2; extra+=("$1") ;;
    -h|--help) usage 0 ;;
    *) usage 2 ;;
  esac
  shift
done
[ "$mode" != violation ] || [ ${#extra[@]} -gt 0 ] || usage 2

command -v "$spin" >/dev/null 2>&1 || { echo "check.sh: spin not found. Run, as root: apt-get install -y spin" >&2; exit 2; }
command -v "$cc" >/dev/null 2>&1 || { echo "check.sh: no C compiler ($cc). Run, as root: apt-get install -y build-essential" >&2; exit 2; }
if [ -z "$work" ]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/kvfuse-model.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work" || exit 2

# build DIR OPT FLAGS...: spin -a and cc into DIR, the model copied there (the trail goes
# next to it). pan may use at most 2 GiB; a search that needs more is incomplete and fails.
build() {
  local dir=$1 opt=$2
  shift 2
  rm -rf "$dir" && mkdir -p "$dir" && cp "$model" "$dir/" || return 1
  (cd "$dir" && "$spin" -a "$@" load_protocol.pml >spin.out 2>&1) || { cat "$dir/spin.out" >&2; return 1; }
  (cd "$dir" && "$cc" "$opt" -w -DSAFETY -DMEMLIM=2048 -o pan pan.c 2>cc.out) || { cat "$dir/cc.out" >&2; return 1; }
}

# field FILE WHAT: a number from pan's report
errors_of() { sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$1" | head -1; }
stored_of() { sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$1" | head -1; }
transitions_of() { sed -n 's/^ *\([0-9.e+]*\) transitions.*/\1/p' "$1" | head -1; }
seconds_of() { sed -n 's/^pan: elapsed time \([0-9.e+]*\) seconds.*/\1/p' "$1" | head -1; }

# The trail as a story: the model's printf lines and spin's verdict, not the variable dump.
story() {
  (cd "$1" && "$spin" -t "${@:2}" load_protocol.pml 2>&1) | awk '
    /^spin: trail ends/ { print; exit }
    /^\t\t/ || /^ *$/ { next }
    { print }'
}

status=0
case "$mode" in
  properties)
    # One size per job, at most $jobs at once; the report comes in the order of SIZES.
    search() {
      local dir=$1 start
      shift
      build "$dir" -O2 "$@" || { echo build >"$dir/verdict"; return; }
      start=$(date +%s.%N)
      (cd "$dir" && ./pan -m20000 -w23 -n >pan.out 2>&1)
      awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }' >"$dir/seconds"
      echo done >"$dir/verdict"
    }
    n=0
    for size in "${SIZES[@]}"; do
      n=$((n + 1))
      read -r -a flags <<< "${size#*|}"
      while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
      mkdir -p "$work/size$n"
      search "$work/size$n" "${flags[@]}" &
    done
    wait
    n=0
    for size in "${SIZES[@]}"; do
      n=$((n + 1))
      name=${size%%|*}
      read -r -a flags <<< "${size#*|}"
      dir=$work/size$n
      errors=$(errors_of "$dir/pan.out" 2>/dev/null)
      if [ "$(cat "$dir/verdict" 2>/dev/null)" != done ] || [ "$errors" != 0 ] ||
         grep -q "Search not completed" "$dir/pan.out"; then
        echo "check.sh: FAILED at $name (${flags[*]}): errors ${errors:-?}" >&2
        grep -E "^pan|Search not completed" "$dir/pan.out" >&2
        [ -f "$dir/load_protocol.pml.trail" ] && story "$dir" "${flags[@]}" >&2
        status=1
        continue
      fi
      printf 'check.sh: %-52s %10s states %11s transitions %6s s, no error\n' \
        "$name" "$(stored_of "$dir/pan.out")" "$(transitions_of "$dir/pan.out")" "$(cat "$dir/seconds")"
    done
    [ "$status" -eq 0 ] && echo "check.sh: every load settled once or was reclaimed, nothing stranded, every admission freed once, nothing freed under a writer, no record settled another generation"
    ;;
  control|violation)
    read -r -a flags <<< "$FIRST"
    if [ "$mode" = control ]; then
      flags+=(-DSTRANDED_BUG -DLOADS_ONLY)
    else
      flags+=("${extra[@]}")
    fi
    dir=$work/$mode
    build "$dir" -O2 "${flags[@]}" || exit 1
    (cd "$dir" && ./pan -m20000 -w23 -n >pan.out 2>&1)
    errors=$(errors_of "$dir/pan.out")
    if [ "${errors:-0}" -eq 0 ] || [ ! -f "$dir/load_protocol.pml.trail" ]; then
      echo "check.sh: spin found no error with ${flags[*]}: the model cannot tell this variant from the code" >&2
      exit 1
    fi
    violated=$(grep -m1 "violated" "$dir/pan.out")
    if [ "$mode" = control ] && ! grep -q "(pk\[cq\]==0)" <<< "$violated"; then
      echo "check.sh: the control failed for another reason than a stranded request: $violated" >&2
      story "$dir" "${flags[@]}" >&2
      exit 1
    fi
    echo "check.sh: spin found it (${flags[*]}): $violated"
    echo "check.sh: the trail ($dir/load_protocol.pml.trail):"
    story "$dir" "${flags[@]}"
    ;;
  coverage)
    read -r -a flags <<< "$FIRST"
    for n in $COVERED; do
      dir=$work/cover$n
      build "$dir" -O0 "${flags[@]}" "-DCOVER_ID=$n" || { status=1; continue; }
      (cd "$dir" && ./pan -m20000 -w20 -n >pan.out 2>&1)
      if grep -q "assertion violated ($n!=$n)" "$dir/pan.out"; then
        echo "check.sh: COVER($n) reached"
      else
        echo "check.sh: COVER($n) is never reached: what the properties say about it is empty" >&2
        status=1
      fi
    done
    ;;
esac
exit "$status"
