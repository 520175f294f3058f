# Writes a C++ file that holds the Metal kernel source as one raw string
# literal, for the Metal backend's run-time fallback (the host compiles it with
# fast math off when no .metallib loads: csrc/backends/metal/metal_library.h),
# and the list of kernel host names the source instantiates.
#
#   cmake -DOUTPUT=<file.cc> [-DMETAL_DIR=<dir>] [-DALLOW_MISSING=ON] [-DSOURCE_OUTPUT=<file.metal>]
#         -P embed_metal_source.cmake
#
# The source is every METAL_DIR/*.metal (default: this folder) in a fixed order
# (reshape_and_cache, paged_attention_decode, paged_attention_merge,
# paged_attention_prefill, then any other alphabetically), with each local
# quoted include (pagedserve_args.h, kernel_utils.h, ...) inlined once where it
# is first included and its `#pragma once` dropped; system includes
# (<metal_stdlib>) stay. The host names are the string literals of
# `[[host_name("...")]]` attributes and the first arguments of
# `PAGEDSERVE_INSTANTIATE_KERNEL("...", kernel, T)` (metal/kernel_utils.h's
# macro, which expands to that attribute), in source order.
#
# SOURCE_OUTPUT also writes the concatenated source itself (tests/metal_source
# compiles it as one translation unit with the emulator's <metal_stdlib>).
#
# Without any .metal file this is an error, unless ALLOW_MISSING is set: then
# the file holds an empty source and no names (the Linux test build uses that,
# so the build goes on and tests/metal_source reports what is missing).
# Plain CMake, so it runs on every platform (ctest runs it on Linux).
cmake_minimum_required(VERSION 3.18)

if(NOT DEFINED OUTPUT OR OUTPUT STREQUAL "")
  message(FATAL_ERROR "embed_metal_source.cmake: pass -DOUTPUT=<file.cc>")
endif()
if(NOT DEFINED METAL_DIR OR METAL_DIR STREQUAL "")
  set(METAL_DIR "${CMAKE_CURRENT_LIST_DIR}")
endif()
get_filename_component(METAL_DIR "${METAL_DIR}" ABSOLUTE)

set(_kernel_order reshape_and_cache paged_attention_decode paged_attention_merge paged_attention_prefill)
file(GLOB _present RELATIVE "${METAL_DIR}" "${METAL_DIR}/*.metal")
list(SORT _present)
set(_files "")
foreach(_name IN LISTS _kernel_order)
  if("${_name}.metal" IN_LIST _present)
    list(APPEND _files "${_name}.metal")
  endif()
endforeach()
foreach(_file IN LISTS _present)
  if(NOT _file IN_LIST _files)
    list(APPEND _files "${_file}")
  endif()
endforeach()

if(NOT _files AND NOT ALLOW_MISSING)
  message(FATAL_ERROR "embed_metal_source.cmake: no Metal kernel source (*.metal) in ${METAL_DIR}; expected "
                      "reshape_and_cache.metal, paged_attention_decode.metal, paged_attention_merge.metal and "
                      "paged_attention_prefill.metal")
endif()

set_property(GLOBAL PROPERTY _pagedserve_inlined "")

# Replaces the first occurrence of `needle` in `text_var` with `replacement`.
function(_pagedserve_replace_first text_var needle replacement)
  string(FIND "${${text_var}}" "${needle}" _at)
  if(_at LESS 0)
    return()
  endif()
  string(LENGTH "${needle}" _len)
  string(SUBSTRING "${${text_var}}" 0 ${_at} _head)
  math(EXPR _rest_at "${_at} + ${_len}")
  string(SUBSTRING "${${text_var}}" ${_rest_at} -1 _tail)
  set(${text_var} "${_head}${replacement}${_tail}" PARENT_SCOPE)
endfunction()

# The text of `path` with its local quoted includes inlined (each file once in
# the whole output); `#pragma once` dropped from inlined headers.
function(_pagedserve_inline path is_header out_var)
  file(READ "${path}" _text)
  if(is_header)
    string(REGEX REPLACE "#[ \t]*pragma[ \t]+once[^\n]*" "" _text "${_text}")
  endif()
  get_filename_component(_dir "${path}" DIRECTORY)
  string(REGEX MATCHALL "#[ \t]*include[ \t]*\"[^\"\n]+\"" _includes "${_text}")
  foreach(_inc IN LISTS _includes)
    string(REGEX REPLACE "#[ \t]*include[ \t]*\"([^\"\n]+)\"" "\\1" _name "${_inc}")
    get_filename_component(_target "${_dir}/${_name}" ABSOLUTE)
    if(NOT EXISTS "${_target}")
      message(FATAL_ERROR "embed_metal_source.cmake: ${path} includes \"${_name}\", which is not in ${_dir}")
    endif()
    get_property(_done GLOBAL PROPERTY _pagedserve_inlined)
    if(_target IN_LIST _done)
      set(_replacement "// (include of ${_name}: inlined above)")
    else()
      set_property(GLOBAL APPEND PROPERTY _pagedserve_inlined "${_target}")
      _pagedserve_inline("${_target}" TRUE _body)
      set(_replacement "// ---- ${_name} (inlined) ----\n${_body}\n// ---- end of ${_name} ----")
    endif()
    _pagedserve_replace_first(_text "${_inc}" "${_replacement}")
    # a second include of the same file in this one: already inlined
    string(REPLACE "${_inc}" "// (include of ${_name}: inlined above)" _text "${_text}")
  endforeach()
  set(${out_var} "${_text}" PARENT_SCOPE)
endfunction()

set(_source "")
set(_names "")
foreach(_file IN LISTS _files)
  _pagedserve_inline("${METAL_DIR}/${_file}" FALSE _body)
  string(APPEND _source "// ==== ${_file} ====\n${_body}\n")
endforeach()

string(REGEX MATCHALL "(host_name|PAGEDSERVE_INSTANTIATE_KERNEL)[ \t]*\\([ \t]*\"[A-Za-z_][A-Za-z0-9_]*\"" _attrs
       "${_source}")
foreach(_attr IN LISTS _attrs)
  string(REGEX REPLACE ".*\"([A-Za-z0-9_]+)\".*" "\\1" _name "${_attr}")
  list(APPEND _names "${_name}")
endforeach()
list(REMOVE_DUPLICATES _names)

set(_delim "PSMETAL")
string(FIND "${_source}" ")${_delim}\"" _clash)
if(NOT _clash LESS 0)
  message(FATAL_ERROR "embed_metal_source.cmake: the kernel source contains the raw-string delimiter )${_delim}\"")
endif()

if(DEFINED SOURCE_OUTPUT AND NOT SOURCE_OUTPUT STREQUAL "")
  file(WRITE "${SOURCE_OUTPUT}" "${_source}")
endif()

list(LENGTH _names _num_names)
set(_name_lines "")
foreach(_name IN LISTS _names)
  string(APPEND _name_lines "    \"${_name}\",\n")
endforeach()
string(REPLACE ";" " " _file_list "${_files}")

file(WRITE "${OUTPUT}"
"// Generated by metal/embed_metal_source.cmake from ${METAL_DIR}: do not edit.
// Files, in order: ${_file_list}
#include \"backends/metal/metal_source.h\"

namespace pagedserve {
namespace metal {

const char kMetalKernelSource[] = R\"${_delim}(${_source})${_delim}\";

const char* const kMetalKernelNames[] = {
${_name_lines}    nullptr,
};

const int kNumMetalKernelNames = ${_num_names};

const char kMetalSourceFiles[] = \"${_file_list}\";

}  // namespace metal
}  // namespace pagedserve
")
