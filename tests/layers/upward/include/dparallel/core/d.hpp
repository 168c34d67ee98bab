#pragma once
// Allowed: a header of the same layer.
