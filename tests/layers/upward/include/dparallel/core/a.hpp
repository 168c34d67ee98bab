#pragma once
// Points up a layer (to policy/) and closes a cycle with policy/b.hpp.
#include <dparallel/policy/b.hpp>
