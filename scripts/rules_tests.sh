#!/usr/bin/env bash
# Keeps the test lists in docs/rules.md equal to the rule tests in tests/*.cpp.
#
#   scripts/rules_tests.sh           rewrite the lists in docs/rules.md from the sources
#   scripts/rules_tests.sh --check   change nothing; exit 1 and show the difference if the
#                                    lists are stale, a rule has no test, or a test names a
#                                    rule the document has no section for
#
# A rule test is a doctest TEST_CASE whose name starts with "R<n> " (docs/rules.md).
# In docs/rules.md each rule's list sits between the lines "<!-- tests R<n> -->" and
# "<!-- /tests -->"; everything between them is generated, everything else is left alone.
# ctest runs the --check form (through scripts/check_docs.sh), so a new or renamed rule test
# fails the suite until this script has been run and the result committed. Needs only bash, grep, sed and awk.
set -euo pipefail
cd "$(dirname "$0")/.."

doc=docs/rules.md
mode=${1:-write}
case "$mode" in
  write | --check) ;;
  *) echo "usage: scripts/rules_tests.sh [--check]" >&2; exit 2 ;;
esac
[ -f "$doc" ] || { echo "rules_tests.sh: $doc not found" >&2; exit 2; }

# One line per rule test, in file order then line order: "<n><TAB><file><TAB><name>".
tests=$(grep -n 'TEST_CASE("R[0-9]' tests/*.cpp | sort -t: -k1,1 -k2,2n |
  sed -E 's/^([^:]+):[0-9]+:.*TEST_CASE\("((\\.|[^"\\])*)".*$/\1\t\2/' |
  awk -F'\t' '{ n = $2; sub(/^R/, "", n); sub(/[^0-9].*$/, "", n); print n "\t" $1 "\t" $2 }')

generated=$(mktemp)
listing=$(mktemp)
trap 'rm -f "$generated" "$listing"' EXIT
printf '%s\n' "$tests" > "$listing"

# Rewrites every marked list. Files are links relative to docs/.
awk -F'\t' '
  NR == FNR {
    if ($0 == "") next
    n = $1; file = $2; name = $3
    if (lastfile[n] != file) {
      listed[n] = listed[n] "- [`" file "`](../" file ")\n"
      lastfile[n] = file
    }
    listed[n] = listed[n] "  - " name "\n"
    next
  }
  /^<!-- tests R[0-9]+ -->$/ {
    print
    n = $0; sub(/^<!-- tests R/, "", n); sub(/ -->$/, "", n)
    if (n in listed) printf "%s", listed[n]
    else print "- none yet"
    skipping = 1
    next
  }
  /^<!-- \/tests -->$/ { skipping = 0 }
  !skipping { print }
' "$listing" "$doc" > "$generated"

problems=0
missing_sections=$(awk -F'\t' '{ print $1 }' <<< "$tests" | sort -un | while read -r n; do
  grep -qx "<!-- tests R$n -->" "$doc" || echo "R$n"
done)
if [ -n "$missing_sections" ]; then
  echo "rules_tests.sh: rule tests exist for $(echo $missing_sections) but $doc has no section for them" >&2
  problems=1
fi
if grep -qx -- '- none yet' "$generated"; then
  echo "rules_tests.sh: a rule in $doc has no test (every rule needs at least one):" >&2
  grep -B1 -x -- '- none yet' "$generated" | grep -o 'R[0-9]*' | sed 's/^/  /' >&2
  problems=1
fi

if [ "$mode" = --check ]; then
  if ! diff -u "$doc" "$generated" > /dev/null; then
    echo "rules_tests.sh: $doc lists other rule tests than tests/*.cpp has. Run scripts/rules_tests.sh and commit:" >&2
    diff -u --label "$doc (committed)" --label "$doc (from tests/*.cpp)" "$doc" "$generated" >&2 || true
    problems=1
  fi
  [ "$problems" -eq 0 ] && echo "rules_tests.sh: $doc lists all $(grep -c . <<< "$tests") rule tests"
  exit "$problems"
fi

cmp -s "$doc" "$generated" || cp "$generated" "$doc"
echo "rules_tests.sh: wrote the lists of $(grep -c . <<< "$tests") rule tests into $doc"
exit "$problems"
