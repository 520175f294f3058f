// Declarations-only stand-in for a Linux syntax check (see ../README.md).
#pragma once
#include <stddef.h>
typedef struct objc_class* Class;
typedef struct objc_object {
  Class isa;
}* id;
typedef struct objc_selector* SEL;
typedef struct objc_protocol Protocol;
typedef signed char BOOL;
extern "C" {
Class objc_lookUpClass(const char* name);
SEL sel_registerName(const char* name);
Protocol* objc_getProtocol(const char* name);
}
