# Finds hiredis (Debian libhiredis-dev) and wraps it in kvfuse::hiredis, for RedisTier
# (<kvfuse/tier/redis_tier.hpp>, linked through kvfuse::redis). pkg-config's answer is used
# as a hint; the header and library are then found directly, so a consumer of the installed
# package needs no pkg-config. Nothing else in kvfuse needs hiredis.
if(NOT TARGET kvfuse::hiredis)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(KVFUSE_PC_HIREDIS QUIET hiredis)
  endif()
  find_path(KVFUSE_HIREDIS_INCLUDE_DIR hiredis/hiredis.h HINTS ${KVFUSE_PC_HIREDIS_INCLUDEDIR})
  find_library(KVFUSE_HIREDIS_LIBRARY hiredis HINTS ${KVFUSE_PC_HIREDIS_LIBDIR})
  if(KVFUSE_HIREDIS_INCLUDE_DIR AND KVFUSE_HIREDIS_LIBRARY)
    add_library(kvfuse::hiredis UNKNOWN IMPORTED)
    set_target_properties(kvfuse::hiredis PROPERTIES
      IMPORTED_LOCATION "${KVFUSE_HIREDIS_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${KVFUSE_HIREDIS_INCLUDE_DIR}")
  endif()
endif()
