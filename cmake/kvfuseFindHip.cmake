# Finds the HIP runtime header and library directly and wraps them in kvfuse::amdhip64.
# Debian's find_package(hip) config insists on hipcc; kvfuse launches no kernels, so host
# compilation with __HIP_PLATFORM_AMD__ plus linking amdhip64 is all HipRuntime needs.
if(NOT TARGET kvfuse::amdhip64)
  find_path(KVFUSE_HIP_INCLUDE_DIR hip/hip_runtime_api.h PATHS /opt/rocm/include)
  find_library(KVFUSE_HIP_LIBRARY amdhip64 PATHS /opt/rocm/lib)
  if(KVFUSE_HIP_INCLUDE_DIR AND KVFUSE_HIP_LIBRARY)
    add_library(kvfuse::amdhip64 UNKNOWN IMPORTED)
    set_target_properties(kvfuse::amdhip64 PROPERTIES
      IMPORTED_LOCATION "${KVFUSE_HIP_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${KVFUSE_HIP_INCLUDE_DIR}"
      INTERFACE_COMPILE_DEFINITIONS "__HIP_PLATFORM_AMD__")
  endif()
endif()
