# Builds one compile-fail target and passes only if the build fails AND the compiler's
# diagnostic names the expected concept (and matches the regex TEXT, when given).
# Invoked by ctest with -DBUILD_DIR, -DTARGET, -DCONCEPT (empty CONCEPT: the control
# case, which must build) and -DTEXT.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(CONCEPT STREQUAL "")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the control case must compile:\n${out}\n${err}")
  endif()
  return()
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but its policy does not model ${CONCEPT}")
endif()
# GCC names the unsatisfied concept as: required for the satisfaction of 'Concept<...>'
string(REGEX MATCH "satisfaction of [^A-Za-z]*${CONCEPT}<" named "${out}${err}")
if(NOT named)
  message(FATAL_ERROR "${TARGET} failed to compile, but the diagnostic does not name ${CONCEPT}:\n${out}\n${err}")
endif()
if(NOT TEXT STREQUAL "" AND NOT "${out}${err}" MATCHES "${TEXT}")
  message(FATAL_ERROR "${TARGET} was refused naming ${CONCEPT}, but the diagnostic does not say '${TEXT}':\n${out}\n${err}")
endif()
message(STATUS "${TARGET}: refused, naming ${CONCEPT}")
