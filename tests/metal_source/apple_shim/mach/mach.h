// Declarations-only stand-in for a Linux syntax check (see ../README.md).
#pragma once
#include <math.h>  // INFINITY, which the SDK's headers bring in along the way
typedef unsigned int mach_port_t;
typedef int kern_return_t;
typedef mach_port_t task_id_token_t;
