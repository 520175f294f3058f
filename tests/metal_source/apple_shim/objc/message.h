// Declarations-only stand-in for a Linux syntax check (see ../README.md).
#pragma once
#include <objc/runtime.h>
extern "C" {
void objc_msgSend(void);
void objc_msgSend_stret(void);
void objc_msgSend_fpret(void);
}
