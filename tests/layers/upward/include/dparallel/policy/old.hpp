#pragma once
// Moved: forwards to its new path.
#include <dparallel/policy/b.hpp>
