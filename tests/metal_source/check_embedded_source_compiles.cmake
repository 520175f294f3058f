# The embedded kernel source (all metal/*.metal concatenated, local headers
# inlined once: what the Metal backend compiles at run time) is one valid
# translation unit: parsed as C++ by clang with the Metal emulator's stand-in
# <metal_stdlib> (tests/metal_emu/include), so a helper defined in two .metal
# files, or a header inlined twice, fails here and not only at run time on a Mac.
#   cmake -DCLANGXX=<clang++> -DSOURCE_DIR=<repo> -DWORK_DIR=<dir> -P check_embedded_source_compiles.cmake
set(_source ${WORK_DIR}/pagedserve_kernels.metal)
execute_process(COMMAND ${CMAKE_COMMAND} -DMETAL_DIR=${SOURCE_DIR}/metal -DOUTPUT=${WORK_DIR}/embedded.cc
                        -DSOURCE_OUTPUT=${_source} -P ${SOURCE_DIR}/metal/embed_metal_source.cmake
                RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "embed_metal_source.cmake failed")
endif()
execute_process(COMMAND ${CLANGXX} -x c++ -std=c++20 -fsyntax-only -Wno-unknown-attributes -Wno-ignored-attributes
                        -I${SOURCE_DIR}/tests/metal_emu/include -I${SOURCE_DIR}/tests/metal_emu ${_source}
                RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "the concatenated kernel source ${_source} is not one valid translation unit (see above)")
endif()
