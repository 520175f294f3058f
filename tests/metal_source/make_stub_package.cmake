# Makes PACKAGE_DIR a copy of the pagedserve package made of symbolic links to
# SOURCE_DIR's entries (python/pagedserve), except the _core module, which the
# metal_stub_core target builds there. cmake -DSOURCE_DIR=... -DPACKAGE_DIR=... -P make_stub_package.cmake
file(MAKE_DIRECTORY "${PACKAGE_DIR}")
file(GLOB _entries RELATIVE "${SOURCE_DIR}" "${SOURCE_DIR}/*")
foreach(_e IN LISTS _entries)
  if(_e MATCHES "^_core" OR _e STREQUAL "__pycache__")
    continue()
  endif()
  if(NOT EXISTS "${PACKAGE_DIR}/${_e}")
    file(CREATE_LINK "${SOURCE_DIR}/${_e}" "${PACKAGE_DIR}/${_e}" SYMBOLIC)
  endif()
endforeach()
