# Checks two example runs' JSON summaries (written by run_example.cmake):
#   cmake -DSINGLE=<single.json> -DOTHER=<dp.json or ddp.json> -DMIN_ACCURACY=0.80 -DREL_TOL_DIGITS=4
#         -P check_example.cmake
# Both runs must reach MIN_ACCURACY on the test set, and the parallel run must train the same
# model as one device:
#  - early_param_sum and early_param_l2 (the parameters after the first early_steps SGD steps) must
#    be bitwise equal: the single run cuts each batch into the shards of the 2 devices (or ranks),
#    computes each in one pass as a device does (mlp::blocking) and sums them as dparallel's
#    reductions do, so the parallel gradient is the one-device gradient to the bit;
#  - param_sum and param_l2 of the trained model within a relative 10^-REL_TOL_DIGITS, and with
#    -DTRAINED_BITWISE=ON bitwise equal as well (the host runs: the last, partial batch of the
#    epoch is cut into the same shards too).
# Optional -DBLAS_FIELDS=ON checks the summaries' OpenBLAS fields (below).
# Optional -DEARLY_BITWISE=OFF skips the bitwise check of the early parameters, which are then
# compared within 10^-REL_TOL_DIGITS only: for --backend cuda runs, whose GPU model sums each
# shard's gradient in cuBLAS's order rather than in the host model's blocks (scripts/gpu-check).

foreach(var SINGLE OTHER MIN_ACCURACY REL_TOL_DIGITS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_example.cmake: expected -D${var}=..., found none")
  endif()
endforeach()

set(failures "")
function(fail)
  string(CONCAT line ${ARGV})
  set(failures "${failures}  - ${line}\n" PARENT_SCOPE)
endfunction()

# Reads a summary; sets <prefix>_<key> for each key (as CMake's JSON reader prints the value) and
# <prefix>_<key>_text (as the program wrote it).
function(read_summary file prefix)
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "check_example.cmake: expected the summary ${file}, found no such file; "
                        "did example_single and example_dp run and pass?")
  endif()
  file(READ "${file}" json)
  foreach(key mode devices epochs global_batch lr seed test_accuracy train_loss samples_per_s param_sum param_l2
              early_steps early_param_sum early_param_l2)
    string(JSON value ERROR_VARIABLE err GET "${json}" ${key})
    if(err)
      message(FATAL_ERROR "check_example.cmake: expected the key \"${key}\" in ${file}, found: ${json}")
    endif()
    set(${prefix}_${key} "${value}" PARENT_SCOPE)
    if(json MATCHES "\"${key}\":([^,}]*)")
      set(${prefix}_${key}_text "${CMAKE_MATCH_1}" PARENT_SCOPE)
    else()
      set(${prefix}_${key}_text "${value}" PARENT_SCOPE)
    endif()
  endforeach()
endfunction()

# Splits a decimal number (as JSON writes it) into sign, a 15-digit integer mantissa and a power of
# ten: value = sign * mantissa * 10^exponent. Zero has mantissa 0. CMake's math() has integers
# only, so the comparison below works on these.
function(split_decimal text out_sign out_mant out_exp)
  if(NOT text MATCHES "^([-+]?)([0-9]*)\\.?([0-9]*)([eE]([-+]?[0-9]+))?$" OR
     (CMAKE_MATCH_2 STREQUAL "" AND CMAKE_MATCH_3 STREQUAL ""))
    message(FATAL_ERROR "check_example.cmake: expected a finite decimal number, found '${text}'")
  endif()
  set(sign "${CMAKE_MATCH_1}")
  set(digits "${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
  string(LENGTH "${CMAKE_MATCH_3}" frac_len)
  set(exp 0)
  if(NOT "${CMAKE_MATCH_5}" STREQUAL "")
    math(EXPR exp "${CMAKE_MATCH_5}")
  endif()
  math(EXPR exp "${exp} - ${frac_len}")
  string(REGEX REPLACE "^0+" "" digits "${digits}")
  string(LENGTH "${digits}" len)
  if(len EQUAL 0)
    set(${out_sign} "+" PARENT_SCOPE)
    set(${out_mant} 0 PARENT_SCOPE)
    set(${out_exp} 0 PARENT_SCOPE)
    return()
  endif()
  if(len GREATER 15)
    string(SUBSTRING "${digits}" 0 15 digits)
    math(EXPR exp "${exp} + ${len} - 15")
  elseif(len LESS 15)
    math(EXPR pad "15 - ${len}")
    string(REPEAT "0" ${pad} zeros)
    string(APPEND digits "${zeros}")
    math(EXPR exp "${exp} - ${pad}")
  endif()
  if(sign STREQUAL "-")
    set(${out_sign} "-" PARENT_SCOPE)
  else()
    set(${out_sign} "+" PARENT_SCOPE)
  endif()
  set(${out_mant} "${digits}" PARENT_SCOPE)
  set(${out_exp} "${exp}" PARENT_SCOPE)
endfunction()

# "1.2e-5" for a count of 1e-9 units such as 12000 (two significant digits, truncated).
function(format_nano out n)
  string(LENGTH "${n}" len)
  if(n EQUAL 0)
    set(text "0")
  else()
    math(EXPR exp "${len} - 10")
    string(SUBSTRING "${n}0" 0 1 d1)
    string(SUBSTRING "${n}0" 1 1 d2)
    set(text "${d1}.${d2}e${exp}")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

# A number shortened for the table: at most 4 decimals, truncated.
function(short out value)
  string(REGEX REPLACE "^([-+]?[0-9]*)(\\.[0-9]?[0-9]?[0-9]?[0-9]?)[0-9]*$" "\\1\\2" value "${value}")
  set(${out} "${value}" PARENT_SCOPE)
endfunction()

# Sets <out_ok> to TRUE when |a - b| <= 10^-digits * max(|a|, |b|), and <out_rel> to the relative
# difference as text ("1.2e-7", or "large").
function(relative_close a b digits out_ok out_rel)
  split_decimal("${a}" sa ma ea)
  split_decimal("${b}" sb mb eb)
  set(ok FALSE)
  set(rel "large")
  if(ma EQUAL 0 OR mb EQUAL 0)
    if(ma EQUAL 0 AND mb EQUAL 0)
      set(ok TRUE)
      set(rel "0")
    endif()
  elseif(sa STREQUAL sb)
    math(EXPR gap "${ea} - ${eb}")
    if(gap EQUAL 1)
      math(EXPR ma "${ma} * 10")
    elseif(gap EQUAL -1)
      math(EXPR mb "${mb} * 10")
    endif()
    if(gap GREATER_EQUAL -1 AND gap LESS_EQUAL 1)
      math(EXPR diff "${ma} - ${mb}")
      if(diff LESS 0)
        math(EXPR diff "0 - ${diff}")
      endif()
      set(ref ${ma})
      if(mb GREATER ma)
        set(ref ${mb})
      endif()
      string(REPEAT "0" ${digits} zeros)
      math(EXPR limit "${ref} / 1${zeros}")
      if(diff LESS_EQUAL limit)
        set(ok TRUE)
      endif()
      math(EXPR rel "${diff} / (${ref} / 1000000000)")
      format_nano(rel ${rel})
    endif()
  endif()
  set(${out_ok} ${ok} PARENT_SCOPE)
  set(${out_rel} ${rel} PARENT_SCOPE)
endfunction()

read_summary("${SINGLE}" single)
read_summary("${OTHER}" dp)

if(NOT single_mode STREQUAL "single")
  fail("${SINGLE}: expected mode \"single\", found \"${single_mode}\"")
endif()
set(other "${dp_mode}")
if(other STREQUAL "single")
  fail("${OTHER}: expected a parallel run, found mode \"single\"")
endif()
foreach(key epochs global_batch lr seed early_steps)
  if(NOT single_${key} STREQUAL dp_${key})
    fail("expected both runs to use the same ${key}, found ${single_${key}_text} (single) and ${dp_${key}_text} (${other})")
  endif()
endforeach()

foreach(run single dp)
  short(${run}_train_loss_text "${${run}_train_loss_text}")
  string(REGEX REPLACE "\\..*$" "" ${run}_samples_per_s_text "${${run}_samples_per_s_text}")
  if(${run}_test_accuracy LESS ${MIN_ACCURACY})
    fail("${run}: expected test_accuracy >= ${MIN_ACCURACY}, found ${${run}_test_accuracy_text}")
  endif()
endforeach()

if(NOT DEFINED EARLY_BITWISE)
  set(EARLY_BITWISE ON)
endif()
set(early_keys early_param_sum early_param_l2)
if(NOT EARLY_BITWISE)
  set(early_keys "")
  message("example_check: EARLY_BITWISE=OFF: the parameters after ${single_early_steps} steps are compared within "
          "1e-${REL_TOL_DIGITS}, not to the bit")
endif()
if(TRAINED_BITWISE)
  list(APPEND early_keys param_sum param_l2)
endif()
foreach(key IN LISTS early_keys)
  if(NOT single_${key}_text STREQUAL dp_${key}_text)
    fail("expected ${other}'s ${key} to equal single's bitwise, found ${dp_${key}_text} (${other}) and "
         "${single_${key}_text} (single): ${other} no longer computes the one-device gradient to the bit")
  endif()
endforeach()
# Within 10^-REL_TOL_DIGITS relative. With -DTRAINED_SUM=OFF (scripts/gpu-check: the GPU runs,
# whose shard gradients round differently from the whole batch's) the trained param_sum is
# reported, not checked: a sum of ~400k parameters of both signs is a hundred times smaller than
# sqrt(N) times their norm, so the rounding differences that grow over an epoch of SGD move it far
# more, relatively, than the norm, which is checked; the early parameters show the gradient is
# the same.
set(close_keys param_sum param_l2 early_param_sum early_param_l2)
if(DEFINED TRAINED_SUM AND NOT TRAINED_SUM)
  set(close_keys param_l2 early_param_sum early_param_l2)
  relative_close("${single_param_sum}" "${dp_param_sum}" ${REL_TOL_DIGITS} ok rel_param_sum)
  set(sum_note " (reported, not checked)")
endif()
foreach(key IN LISTS close_keys)
  relative_close("${single_${key}}" "${dp_${key}}" ${REL_TOL_DIGITS} ok rel_${key})
  if(NOT ok)
    fail("expected ${other}'s ${key} to equal single's within 1e-${REL_TOL_DIGITS} relative, found "
         "${dp_${key}_text} (${other}) and ${single_${key}_text} (single), a relative difference of ${rel_${key}}: "
         "${other} no longer trains the same model as one device")
  endif()
endforeach()

# With -DBLAS_FIELDS=ON (train_mlp's runs): each summary names the OpenBLAS kernel it ran on
# (blas_kernel, a non-empty string), whether that is a generic one (blas_kernel_generic) and the
# OPENBLAS_CORETYPE the environment set (blas_coretype_env, a string or null).
if(BLAS_FIELDS)
  foreach(file IN ITEMS "${SINGLE}" "${OTHER}")
    file(READ "${file}" json)
    string(JSON kernel_type ERROR_VARIABLE err1 TYPE "${json}" blas_kernel)
    string(JSON kernel ERROR_VARIABLE err2 GET "${json}" blas_kernel)
    string(JSON generic_type ERROR_VARIABLE err3 TYPE "${json}" blas_kernel_generic)
    string(JSON env_type ERROR_VARIABLE err4 TYPE "${json}" blas_coretype_env)
    if(err1 OR err2 OR err3 OR err4 OR NOT kernel_type STREQUAL "STRING" OR kernel STREQUAL "" OR
       NOT generic_type STREQUAL "BOOLEAN" OR NOT env_type MATCHES "^(STRING|NULL)$")
      fail("expected ${file} to name the OpenBLAS kernel (blas_kernel: a non-empty string, blas_kernel_generic: "
           "true or false, blas_coretype_env: a string or null), found: ${json}")
    endif()
  endforeach()
endif()

# Throughput of dp relative to single, in percent (a report, never a pass/fail criterion).
string(REGEX REPLACE "[.eE].*$" "" single_rate "${single_samples_per_s}")
string(REGEX REPLACE "[.eE].*$" "" dp_rate "${dp_samples_per_s}")
set(ratio "?")
if(single_rate GREATER 0 AND dp_rate GREATER_EQUAL 0)
  math(EXPR ratio "${dp_rate} * 100 / ${single_rate}")
endif()

message("example_check: single:         test_accuracy ${single_test_accuracy_text}  train_loss ${single_train_loss_text}"
        "  samples/s ${single_samples_per_s_text}  param_sum ${single_param_sum_text}  param_l2 ${single_param_l2_text}")
message("example_check: ${other}, ${dp_devices} devices:  test_accuracy ${dp_test_accuracy_text}  train_loss ${dp_train_loss_text}"
        "  samples/s ${dp_samples_per_s_text}  param_sum ${dp_param_sum_text}  param_l2 ${dp_param_l2_text}")
message("example_check: single: after ${single_early_steps} steps  param_sum ${single_early_param_sum_text}  "
        "param_l2 ${single_early_param_l2_text}")
message("example_check: ${other}:    after ${dp_early_steps} steps  param_sum ${dp_early_param_sum_text}  "
        "param_l2 ${dp_early_param_l2_text}")
message("example_check: ${other} vs single, relative differences (checked within 1e-${REL_TOL_DIGITS}): after "
        "${single_early_steps} steps param_sum ${rel_early_param_sum}, param_l2 ${rel_early_param_l2}; "
        "trained param_sum ${rel_param_sum}${sum_note}, param_l2 ${rel_param_l2}")
message("example_check: ${other} throughput is ${ratio}% of single's (on a loaded machine this ratio means little)")

if(failures)
  message(FATAL_ERROR "example_check failed:\n${failures}")
endif()
message("example_check: passed")
