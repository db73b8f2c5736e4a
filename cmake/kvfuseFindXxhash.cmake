# Finds xxhash.h (Debian libxxhash-dev) and wraps it in kvfuse::xxhash, which the kvfuse
# target needs: the entry checksums (<kvfuse/detail/checksum.hpp>) include xxHash in its
# header-only mode (XXH_INLINE_ALL), so only the header is needed and nothing links.
# Used by kvfuse's own build (CMakeLists.txt) and by the installed package config; when the
# header is missing or too old it defines no target and sets KVFUSE_XXHASH_ERROR to a message
# naming the package to install, and each caller refuses with it.
if(NOT TARGET kvfuse::xxhash)
  set(KVFUSE_XXHASH_ERROR "")
  find_path(KVFUSE_XXHASH_INCLUDE_DIR xxhash.h)
  if(NOT KVFUSE_XXHASH_INCLUDE_DIR)
    string(CONCAT KVFUSE_XXHASH_ERROR "kvfuse needs xxhash.h (xxHash 0.8 or later, header only), which was not found. "
                                      "On Debian or Ubuntu, run as root: apt-get install -y libxxhash-dev "
                                      "(or set KVFUSE_XXHASH_INCLUDE_DIR to the folder holding xxhash.h).")
  else()
    file(STRINGS "${KVFUSE_XXHASH_INCLUDE_DIR}/xxhash.h" kvfuse_xxhash_version_lines
         REGEX "^#define XXH_VERSION_(MAJOR|MINOR) +[0-9]+")
    string(REGEX MATCH "XXH_VERSION_MAJOR +([0-9]+)" _ "${kvfuse_xxhash_version_lines}")
    set(kvfuse_xxhash_major "${CMAKE_MATCH_1}")
    string(REGEX MATCH "XXH_VERSION_MINOR +([0-9]+)" _ "${kvfuse_xxhash_version_lines}")
    set(kvfuse_xxhash_minor "${CMAKE_MATCH_1}")
    if("${kvfuse_xxhash_major}.${kvfuse_xxhash_minor}" VERSION_LESS 0.8)
      string(CONCAT KVFUSE_XXHASH_ERROR "kvfuse needs xxHash 0.8 or later (XXH3 is stable from 0.8), but "
                                        "${KVFUSE_XXHASH_INCLUDE_DIR}/xxhash.h is ${kvfuse_xxhash_major}.${kvfuse_xxhash_minor}. "
                                        "On Debian or Ubuntu, run as root: apt-get install -y libxxhash-dev")
    else()
      add_library(kvfuse::xxhash INTERFACE IMPORTED)
      set_target_properties(kvfuse::xxhash PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${KVFUSE_XXHASH_INCLUDE_DIR}")
    endif()
  endif()
endif()
