# ctest: the model generator writes the same bytes on every run. Runs it twice into fresh
# directories and compares each model with the other run's and with the build's own.
#   cmake -DPYTHON=... -DGGUF_PY=... -DGENERATOR=... -DBUILT=<the build's models> -DWORK=<scratch> -P check_models.cmake
file(REMOVE_RECURSE "${WORK}")
foreach(run a b)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env "PYTHONPATH=${GGUF_PY}" "${PYTHON}" "${GENERATOR}" "${WORK}/${run}"
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the model generator failed (exit ${rc})")
  endif()
endforeach()
foreach(arch llama kimi-k3 deepseek4)
  foreach(other "${WORK}/b" "${BUILT}")
    execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files "${WORK}/a/${arch}.gguf" "${other}/${arch}.gguf" RESULT_VARIABLE differ)
    if(NOT differ EQUAL 0)
      message(FATAL_ERROR "${arch}.gguf differs between two runs of the generator (${WORK}/a and ${other})")
    endif()
  endforeach()
  file(SHA256 "${WORK}/a/${arch}.gguf" sum)
  message(STATUS "${arch}.gguf ${sum}")
endforeach()
file(REMOVE_RECURSE "${WORK}")
