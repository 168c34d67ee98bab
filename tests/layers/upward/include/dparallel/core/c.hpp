#pragma once
// Includes a forwarding header instead of the header it forwards to.
#include <dparallel/core/d.hpp>
#include "../policy/old.hpp"
