#pragma once
// Allowed: a header of a lower layer.
#include <dparallel/core/a.hpp>
// #include <dparallel/misc/x.hpp> (a comment, not an include)
