#pragma once
// In no layer of the table.
