#!/usr/bin/env bash
# Entry point of the README's commands: `./make.sh demo`, `./make.sh test`, `./make.sh bench`.
# Installs the Debian packages kvfuse needs (make and a compiler included) when run as
# root, or prints the apt-get line to run otherwise, then hands over to make.
set -euo pipefail
cd "$(dirname "$0")"
scripts/deps.sh
exec make "$@"
