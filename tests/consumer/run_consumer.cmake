# Builds and runs a tiny consumer of kvfuse, as an engine would.
#   MODE=find_package : install kvfuse into a temp prefix, then find_package(kvfuse CONFIG REQUIRED)
#   MODE=subdirectory : add_subdirectory(<kvfuse source>)
# Invoked by ctest with -DKVFUSE_SOURCE=... -DWORK=... -DMODE=... -DCXX_COMPILER=... (the
# compiler the suite itself was configured with: every build here uses the same one, as
# an engine built with another compiler than the default would).
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

function(run)
  execute_process(COMMAND ${ARGV} WORKING_DIRECTORY ${WORK} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}\n${out}\n${err}")
  endif()
  message("${out}")
endfunction()

if(NOT CXX_COMPILER)
  message(FATAL_ERROR "CXX_COMPILER is not set: pass -DCXX_COMPILER=<the suite's C++ compiler>")
endif()
set(compiler -DCMAKE_CXX_COMPILER=${CXX_COMPILER})

# The consumer needs only the headers. The llama.cpp integration is off unless asked for,
# even at the top level: this configure does not name it, and the cache must say OFF (a
# plain configure fetches nothing). Its own tests, the two-pass comparisons and the controls
# that must make them differ (a flipped KV byte, a state of the wrong boundary), live in
# integrations/llama/ and apps/llama/.
if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} -S ${KVFUSE_SOURCE} -B ${WORK}/kvfuse-build ${compiler} -DKVFUSE_BUILD_TESTS=OFF
      -DKVFUSE_BUILD_BENCH=OFF -DKVFUSE_BUILD_EXAMPLES=OFF -DKVFUSE_BUILD_APPS=OFF
      -DCMAKE_INSTALL_PREFIX=${WORK}/prefix)
  file(STRINGS ${WORK}/kvfuse-build/CMakeCache.txt llama_option REGEX "^KVFUSE_BUILD_LLAMA:BOOL=")
  if(NOT llama_option STREQUAL "KVFUSE_BUILD_LLAMA:BOOL=OFF")
    message(FATAL_ERROR "a top-level configure that does not name KVFUSE_BUILD_LLAMA got '${llama_option}': "
                        "it must default to OFF, so that configuring the header-only library fetches nothing")
  endif()
  run(${CMAKE_COMMAND} --install ${WORK}/kvfuse-build)
  run(${CMAKE_COMMAND} -S ${KVFUSE_SOURCE}/tests/consumer/find_package -B ${WORK}/consumer-build ${compiler}
      -DCMAKE_PREFIX_PATH=${WORK}/prefix)
elseif(MODE STREQUAL "subdirectory")
  run(${CMAKE_COMMAND} -S ${KVFUSE_SOURCE}/tests/consumer/subdirectory -B ${WORK}/consumer-build ${compiler}
      -DKVFUSE_SOURCE=${KVFUSE_SOURCE})
else()
  message(FATAL_ERROR "MODE must be find_package or subdirectory, got '${MODE}'")
endif()
run(${CMAKE_COMMAND} --build ${WORK}/consumer-build)
run(${WORK}/consumer-build/consumer)
