// Declarations-only stand-in for a Linux syntax check (see ../README.md).
#pragma once
#include <CoreFoundation/CoreFoundation.h>
