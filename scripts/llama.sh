#!/usr/bin/env bash
# Obtains llama.cpp at the one commit kvfuse's llama integration is written against, checks
# that commit, and builds it once (CPU only, static libraries) into a directory every build
# tree of this checkout shares: the libraries, the stock llama-server, and the libraries of
# the server patched with kvfuse's prompt cache backend hook (a copy of tools/server with
# integrations/llama/server/prompt_cache_backend.patch applied, built in the same tree
# against the same targets, so nothing of llama.cpp is compiled twice). Called by integrations/llama/CMakeLists.txt at
# configure time; safe to run by hand. A second run with the same inputs does nothing.
#
#   scripts/llama.sh [DIR]        DIR defaults to <repo>/build/_deps/llama
#
# Where the source comes from:
#   KVFUSE_LLAMA_SOURCE=/path     a git checkout of llama.cpp at the pinned commit, with no
#                                 local changes to tracked files; used in place, never written
#   otherwise                     the npm package node-llama-cpp (it ships llama.cpp as a git
#                                 bundle); the tarball is kept in KVFUSE_LLAMA_CACHE
#                                 (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvfuse), so a clean
#                                 build tree does not fetch it again
# JOBS sets the build's parallelism (default: nproc).
#
# On success DIR holds install/ (headers, static libraries, CMake package files), build/
# (where the stock llama-server and the server libraries are), server-kvfuse/ (the patched
# copy of tools/server), paths.cmake (those paths, for CMake to include) and a stamp. A
# patch that no longer applies stops here, naming the file and the hunk. Any missing
# tool or failed step stops with a message naming what to install or do; nothing is skipped.
set -euo pipefail

readonly pinned_commit=80fb11ac73e66d89eae2c6a91d8a77428fa733ed
readonly npm_package=node-llama-cpp@3.21.1
readonly npm_tarball=node-llama-cpp-3.21.1.tgz
readonly bundle_path=package/llama/gitRelease.bundle
readonly patch_name=integrations/llama/server/prompt_cache_backend.patch
readonly patch_cmake_name=integrations/llama/server/patched_server.cmake

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$repo/build/_deps/llama}
jobs=${JOBS:-$(nproc)}

fail() {
  echo "kvfuse llama: $*" >&2
  exit 1
}
need() {  # need TOOL DEBIAN_PACKAGES...
  command -v "$1" >/dev/null 2>&1 ||
    fail "'$1' was not found. Run, as root: apt-get install -y ${*:2}  (or scripts/deps.sh)"
}

# The build options are part of the stamp: changing them here rebuilds.
# The tools are configured (the server needs common and mtmd, which live there) but only
# the server's targets are built; none is installed but the library's own, and the web UI
# is left out (the server then answers its API only, which is all kvfuse uses).
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON
            -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
            -DLLAMA_TOOLS_INSTALL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
            -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON -DGGML_NATIVE=ON)

need git git
need cmake cmake
need flock util-linux

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
# Build trees configured at the same time (make -j over several) build it once.
exec 9>"$dir/.lock"
flock 9

if [ -n "${KVFUSE_LLAMA_SOURCE:-}" ]; then
  [ -d "$KVFUSE_LLAMA_SOURCE" ] || fail "KVFUSE_LLAMA_SOURCE=$KVFUSE_LLAMA_SOURCE is not a directory"
  source_dir=$(cd "$KVFUSE_LLAMA_SOURCE" && pwd)
else
  source_dir=$dir/src
fi

need sha256sum coreutils
need patch patch
[ -f "$repo/$patch_name" ] || fail "$repo/$patch_name is missing"
stamp_text="commit $pinned_commit
source $source_dir
options ${cmake_args[*]}
patch $(sha256sum <"$repo/$patch_name" | cut -d' ' -f1) $(sha256sum <"$repo/$patch_cmake_name" | cut -d' ' -f1)"
if [ -f "$dir/stamp" ] && [ "$(cat "$dir/stamp")" = "$stamp_text" ] &&
   [ -f "$dir/install/lib/libllama.a" ] && [ -f "$dir/paths.cmake" ] && [ -x "$dir/build/bin/llama-server" ]; then
  exit 0
fi
rm -f "$dir/stamp"

check_commit() {  # check_commit SOURCE_DIR
  local head
  head=$(git -C "$1" rev-parse HEAD 2>/dev/null) ||
    fail "$1 is not a git checkout, so its commit cannot be checked; kvfuse needs llama.cpp at $pinned_commit"
  [ "$head" = "$pinned_commit" ] ||
    fail "$1 is at commit $head; kvfuse needs llama.cpp at $pinned_commit (git -C $1 checkout $pinned_commit)"
  git -C "$1" diff --quiet HEAD -- ||
    fail "$1 has local changes to tracked files; kvfuse needs llama.cpp exactly at $pinned_commit"
}

if [ -n "${KVFUSE_LLAMA_SOURCE:-}" ]; then
  echo "kvfuse llama: using the source in $source_dir" >&2
  check_commit "$source_dir"
else
  if [ -d "$source_dir/.git" ] && git -C "$source_dir" rev-parse HEAD >/dev/null 2>&1 &&
     [ "$(git -C "$source_dir" rev-parse HEAD)" = "$pinned_commit" ]; then
    :
  else
    cache=${KVFUSE_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfuse}
    mkdir -p "$cache"
    if [ ! -s "$cache/$npm_tarball" ]; then
      need npm "nodejs npm"
      echo "kvfuse llama: fetching $npm_package (35 MB) into $cache" >&2
      fetch=$(mktemp -d "$cache/fetch.XXXXXX")
      if ! (cd "$fetch" && npm pack --silent "$npm_package" >/dev/null); then
        rm -rf "$fetch"
        fail "'npm pack $npm_package' failed. kvfuse needs the npm registry (or a copy of $npm_tarball in $cache, or KVFUSE_LLAMA_SOURCE=<a llama.cpp checkout at $pinned_commit>)"
      fi
      mv "$fetch/$npm_tarball" "$cache/$npm_tarball"
      rm -rf "$fetch"
    fi
    unpack=$(mktemp -d "$dir/unpack.XXXXXX")
    tar -xzf "$cache/$npm_tarball" -C "$unpack" "$bundle_path" ||
      fail "$cache/$npm_tarball does not hold $bundle_path; delete it and run again"
    rm -rf "$source_dir"
    git clone --quiet --no-checkout "$unpack/$bundle_path" "$source_dir" ||
      fail "cloning the git bundle of $cache/$npm_tarball failed; delete it and run again"
    git -C "$source_dir" -c advice.detachedHead=false checkout --quiet "$pinned_commit" ||
      fail "the bundle in $cache/$npm_tarball does not hold commit $pinned_commit"
    rm -rf "$unpack"
  fi
  check_commit "$source_dir"
fi

# The patched copy of tools/server: built afresh in a scratch folder, then copied over the
# previous one file by file only where a file changed, so a rebuild recompiles only those.
patched=$dir/server-kvfuse
scratch=$(mktemp -d "$dir/patching.XXXXXX")
cp -R "$source_dir/tools/server/." "$scratch/"
if ! out=$(cd "$scratch" && patch -p3 --forward --batch --no-backup-if-mismatch <"$repo/$patch_name" 2>&1); then
  rm -rf "$scratch"
  fail "$patch_name no longer applies to llama.cpp $pinned_commit:
$out"
fi
mkdir -p "$patched"
(cd "$scratch" && find . -type f) | while read -r f; do
  if ! cmp -s "$scratch/$f" "$patched/$f"; then mkdir -p "$(dirname "$patched/$f")" && cp "$scratch/$f" "$patched/$f"; fi
done
(cd "$patched" && find . -type f) | while read -r f; do [ -e "$scratch/$f" ] || rm -f "$patched/$f"; done
rm -rf "$scratch"
cmp -s "$repo/$patch_cmake_name" "$dir/patched_server.cmake" || cp "$repo/$patch_cmake_name" "$dir/patched_server.cmake"

echo "kvfuse llama: building llama.cpp $pinned_commit (CPU, static) and its server in $dir with $jobs jobs" >&2
start=$(date +%s)
cmake -S "$source_dir" -B "$dir/build" "${cmake_args[@]}" -DCMAKE_INSTALL_PREFIX="$dir/install" \
      "-DCMAKE_PROJECT_llama.cpp_INCLUDE=$dir/patched_server.cmake" "-DKVFUSE_PATCHED_SERVER_DIR=$patched" \
      >"$dir/configure.log" 2>&1 || fail "configuring llama.cpp failed; see $dir/configure.log"
cmake --build "$dir/build" --target llama mtmd llama-server kvfuse-server-impl -j "$jobs" >"$dir/build.log" 2>&1 ||
  fail "building llama.cpp failed; see $dir/build.log"
rm -rf "$dir/install"
cmake --install "$dir/build" >"$dir/install.log" 2>&1 || fail "installing llama.cpp failed; see $dir/install.log"
echo "kvfuse llama: built in $(($(date +%s) - start)) s" >&2

cat >"$dir/paths.cmake" <<EOF
# Written by scripts/llama.sh: where the llama.cpp build at $pinned_commit lives.
set(KVFUSE_LLAMA_COMMIT "$pinned_commit")
set(KVFUSE_LLAMA_SOURCE_DIR "$source_dir")
set(KVFUSE_LLAMA_INSTALL_DIR "$dir/install")
set(KVFUSE_LLAMA_BUILD_DIR "$dir/build")
set(KVFUSE_LLAMA_PATCHED_SERVER_DIR "$patched")
EOF
printf '%s' "$stamp_text" >"$dir/stamp"
