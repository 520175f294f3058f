# cmake -DNM=<nm> -DOBJECTS=<a;b;...> -P check_isa_objects.cmake
# Fails if any kernel object defines a weak (COMDAT) symbol: see CMakeLists.txt.
# One is allowed: DW.ref.__gxx_personality_v0, the data word through which an
# object's unwind tables name libstdc++'s personality routine (the sanitizer
# build's cleanups emit it in attention/kernels.cc). It holds an address, the same in
# every object, and no code compiled for any ISA.
if(NOT NM)
  message(STATUS "no nm: skipped")
  return()
endif()
set(bad "")
foreach(obj IN LISTS OBJECTS)
  if(obj STREQUAL "")
    continue()
  endif()
  execute_process(COMMAND ${NM} -C --defined-only ${obj} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${obj}")
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  foreach(line IN LISTS lines)
    if(line MATCHES "^[0-9a-fA-F]* *[WVu] " AND NOT line MATCHES " DW\\.ref\\.__gxx_personality_v0$")
      list(APPEND bad "${obj}: ${line}")
    endif()
  endforeach()
  message(STATUS "checked ${obj}")
endforeach()
if(bad)
  string(REPLACE ";" "\n" bad "${bad}")
  message(FATAL_ERROR "weak symbols in ISA-specific kernel objects:\n${bad}")
endif()
