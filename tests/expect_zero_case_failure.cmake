# Runs one test executable with a --test-case filter that matches nothing, the way a test
# name with a ',' or ';' would once it reached ctest. Passes only if the run fails AND
# says it matched no test case (tests/doctest_main.cpp); a crash does not pass.
execute_process(COMMAND ${EXE} "--test-case=kvfuse: no test case has this name"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "a run that matched no test case exited 0:\n${out}\n${err}")
endif()
if(NOT "${err}" MATCHES "matched no test case")
  message(FATAL_ERROR "a run that matched no test case failed (${rc}) without saying why:\n${out}\n${err}")
endif()
message(STATUS "a run that matched no test case failed (${rc}), saying so")
