# Locates NCCL and defines the imported target weft::nccl.
# Search order: WEFT_NCCL_ROOT (cache or environment), the CUDA toolkit, then the nvidia/nccl folder of the
# active Python's site-packages (PyTorch wheels ship NCCL there, with only libnccl.so.2 and no dev symlink).
set(_weft_nccl_hints)
if(WEFT_NCCL_ROOT)
  list(APPEND _weft_nccl_hints ${WEFT_NCCL_ROOT})
elseif(DEFINED ENV{WEFT_NCCL_ROOT})
  list(APPEND _weft_nccl_hints $ENV{WEFT_NCCL_ROOT})
endif()
list(APPEND _weft_nccl_hints ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})

find_program(_weft_python NAMES python3 python)
if(_weft_python)
  execute_process(COMMAND ${_weft_python} -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
                  OUTPUT_VARIABLE _weft_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_weft_site AND EXISTS "${_weft_site}/nvidia/nccl")
    list(APPEND _weft_nccl_hints "${_weft_site}/nvidia/nccl")
  endif()
endif()
file(GLOB _weft_venv_nccl /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl)
list(APPEND _weft_nccl_hints ${_weft_venv_nccl})

find_path(WEFT_NCCL_INCLUDE_DIR nccl.h HINTS ${_weft_nccl_hints} PATH_SUFFIXES include NO_CACHE)
find_library(WEFT_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_weft_nccl_hints}
             PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu NO_CACHE)

if(NOT WEFT_NCCL_INCLUDE_DIR OR NOT WEFT_NCCL_LIBRARY)
  message(FATAL_ERROR "weft: NCCL not found (looked in: ${_weft_nccl_hints}). Only weft-bench needs it (its "
                      "baseline): set -DWEFT_NCCL_ROOT=<dir with include/nccl.h and lib/libnccl.so*>, or "
                      "configure with -DWEFT_BUILD_BENCH=OFF.")
endif()
file(STRINGS "${WEFT_NCCL_INCLUDE_DIR}/nccl.h" _weft_nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3"
       WEFT_NCCL_VERSION "${_weft_nccl_ver}")
message(STATUS "weft: NCCL ${WEFT_NCCL_VERSION}: ${WEFT_NCCL_LIBRARY} (headers ${WEFT_NCCL_INCLUDE_DIR})")

add_library(weft::nccl UNKNOWN IMPORTED)
set_target_properties(weft::nccl PROPERTIES
  IMPORTED_LOCATION "${WEFT_NCCL_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${WEFT_NCCL_INCLUDE_DIR}")
