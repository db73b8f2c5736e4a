#!/usr/bin/env bash
# Entry point of the README's commands. Installs the Debian packages kvfuse needs (make and
# a compiler included) when run as root, or prints the apt-get line to run otherwise, then
# hands over to make.
set -euo pipefail
cd "$(dirname "$0")"
if [ $# -eq 0 ]; then
  cat <<'USAGE'
usage: ./make.sh <target>
  demo    build and run the main jobs (kvfuse-replay, then kvfuse-llama); prints their reports
  test    build and run the whole test suite: -Werror build + ctest, then ASan+UBSan, then TSan
  bench   build the benchmarks and kvfuse-replay, print one table, run llama-server side by side, draw the plots (bench/README.md)
  clean   remove build/
USAGE
  exit 0
fi
scripts/deps.sh
exec make "$@"
