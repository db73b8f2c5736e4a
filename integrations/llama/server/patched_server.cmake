# Included by llama.cpp's own top-level CMakeLists.txt (scripts/llama.sh configures it with
# -DCMAKE_PROJECT_llama.cpp_INCLUDE pointing at a copy of this file), so that the patched copy
# of tools/server is built in the same build tree as the stock server: against the very
# targets (llama, ggml, llama-common, mtmd, cpp-httplib, llama-ui) and compile definitions
# the stock one uses, with nothing of llama.cpp compiled twice. The include runs inside
# project(), before any target exists, so the targets are defined at the end of the top
# directory (cmake_language DEFER). KVFUSE_PATCHED_SERVER_DIR is the patched copy.
#
# Two static libraries come out, the patched counterparts of the stock server-context and
# llama-server-impl; main.cpp goes into the second. Their hook symbols
# (server-prompt-cache-backend.h) are left undefined: kvfuse's build links them with the
# adapter that defines them (integrations/llama/server/CMakeLists.txt).
function(kvfuse_add_patched_server)
  set(d "${KVFUSE_PATCHED_SERVER_DIR}")
  if(NOT EXISTS "${d}/server-context.cpp")
    message(FATAL_ERROR "kvfuse: the patched server copy ${d} is missing; run scripts/llama.sh")
  endif()
  add_library(kvfuse-server-context STATIC
      ${d}/server-chat.cpp ${d}/server-task.cpp ${d}/server-queue.cpp ${d}/server-common.cpp
      ${d}/server-context.cpp ${d}/server-stream.cpp ${d}/server-tools.cpp ${d}/server-mcp.cpp
      ${d}/server-schema.cpp)
  target_include_directories(kvfuse-server-context PRIVATE ${d} ${CMAKE_SOURCE_DIR}/tools/mtmd ${CMAKE_SOURCE_DIR})
  target_link_libraries(kvfuse-server-context PUBLIC llama-common mtmd ${CMAKE_THREAD_LIBS_INIT})
  target_compile_features(kvfuse-server-context PRIVATE cxx_std_17)
  add_library(kvfuse-server-impl STATIC ${d}/server.cpp ${d}/server-http.cpp ${d}/server-models.cpp ${d}/main.cpp)
  target_include_directories(kvfuse-server-impl PUBLIC ${d})
  target_include_directories(kvfuse-server-impl PRIVATE ${CMAKE_SOURCE_DIR}/tools/mtmd ${CMAKE_SOURCE_DIR})
  target_link_libraries(kvfuse-server-impl PUBLIC kvfuse-server-context llama-ui cpp-httplib ${CMAKE_THREAD_LIBS_INIT})
  target_compile_features(kvfuse-server-impl PRIVATE cxx_std_17)
  set_target_properties(kvfuse-server-context kvfuse-server-impl PROPERTIES
                        ARCHIVE_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/kvfuse-server")
endfunction()
if(KVFUSE_PATCHED_SERVER_DIR)
  cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL kvfuse_add_patched_server)
endif()
