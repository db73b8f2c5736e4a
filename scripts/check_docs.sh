#!/usr/bin/env bash
# Checks that the documentation still tells the truth about the repository:
#   1. docs/rules.md lists every rule test under its rule (scripts/rules_tests.sh --check);
#   2. every line of README.md's C++ block appears in examples/quick_start.cpp (the quick
#      start is a compiled, tested program; the README only quotes it; "// ..." marks a cut);
#   3. every relative link in the Markdown files resolves to a file or folder in the repo.
# ctest runs it. Exit status 1 names each problem. Needs only bash, grep, sed and awk.
set -uo pipefail
cd "$(dirname "$0")/.."

status=0
fail() { echo "check_docs.sh: $*" >&2; status=1; }

scripts/rules_tests.sh --check || status=1

# 2. The README quick start quotes examples/quick_start.cpp. Each quoted line, trimmed, must
# be part of one line of the program.
example=examples/quick_start.cpp
quoted=$(awk '/^```cpp$/ { inside = 1; next } /^```$/ { inside = 0 } inside' README.md)
[ -n "$quoted" ] || fail "README.md has no C++ block to check against $example"
while IFS= read -r line; do
  trimmed=$(sed -E 's/^[[:space:]]+//; s/[[:space:]]+$//' <<< "$line")
  case "$trimmed" in "" | "// ...") continue ;; esac
  grep -qF -- "$trimmed" "$example" || fail "README.md quotes a line that is not in $example: $trimmed"
done <<< "$quoted"

# 3. Relative links: [text](target) outside code, target without a scheme, resolved
# against the Markdown file's folder. An #anchor must be an explicit <a id="anchor"></a> in
# the target file (the docs give every linked place one, so links survive heading edits).
docs=(README.md CONTRIBUTING.md docs/*.md bench/README.md)
for doc in "${docs[@]}"; do
  [ -f "$doc" ] || continue
  dir=$(dirname "$doc")
  links=$(awk '/^```/ { code = !code; next } !code' "$doc" | sed 's/`[^`]*`//g' |
    grep -oE '\]\([^)[:space:]]+\)' | sed -E 's/^\]\(//; s/\)$//')
  while IFS= read -r target; do
    [ -n "$target" ] || continue
    case "$target" in http://* | https://* | mailto:*) continue ;; esac
    path=${target%%#*}
    [ -n "$path" ] && file="$dir/$path" || file=$doc
    if [ ! -e "$file" ]; then
      fail "$doc links to $target, which does not exist"
    elif [ "$path" != "$target" ] && ! grep -qF "<a id=\"${target#*#}\"></a>" "$file"; then
      fail "$doc links to $target, but $file has no <a id=\"${target#*#}\"></a>"
    fi
  done <<< "$links"
done

[ "$status" -eq 0 ] && echo "check_docs.sh: the rule lists, the README quick start and every relative link are current"
exit "$status"
