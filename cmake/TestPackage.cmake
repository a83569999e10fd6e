# ctest package.find_package: installs this build into a scratch prefix and builds examples/consumer with
# find_package(weft), as a user's project would, and the Python module on its own against it.
# Absolute paths: `cmake --install --prefix` and the consumer's CMAKE_PREFIX_PATH would each read a relative
# one against a different directory.
get_filename_component(WEFT_BUILD ${WEFT_BUILD} ABSOLUTE)
set(prefix ${WEFT_BUILD}/package-test/prefix)
set(consumer ${WEFT_BUILD}/package-test/consumer)
file(REMOVE_RECURSE ${WEFT_BUILD}/package-test)
execute_process(COMMAND ${CMAKE_COMMAND} --install ${WEFT_BUILD} --prefix ${prefix} RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WEFT_SOURCE}/examples/consumer -B ${consumer}
                        -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer with find_package(weft) failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${consumer} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer against the installed weft failed (${rc})")
endif()
message(STATUS "find_package(weft) consumer built: ${consumer}/hello_team")

# The Python module on its own against the same install (python/CMakeLists.txt without the rest of weft).
set(py ${WEFT_BUILD}/package-test/python)
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WEFT_SOURCE}/python -B ${py} -DCMAKE_PREFIX_PATH=${prefix}
                        -DCMAKE_BUILD_TYPE=Release RESULT_VARIABLE rc ERROR_VARIABLE py_err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the Python module against the installed weft failed (${rc}): ${py_err}")
endif()
string(REGEX REPLACE "[ \t\r\n]+" " " py_err "${py_err}")  # (CMake wraps its warnings' lines)
if(py_err MATCHES "the Python package is not built")
  message(STATUS "Python 3 development files or pybind11 missing: the Python module's own build not checked")
  return()
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${py} RESULT_VARIABLE rc)
file(GLOB module ${py}/weft/_weft*.so)
if(NOT rc EQUAL 0 OR NOT module)
  message(FATAL_ERROR "building the Python module against the installed weft failed (${rc})")
endif()
message(STATUS "the Python module built against the installed weft: ${module}")
