// PAGEDSERVE_CPU_RELAX(): the hint a polling loop gives the core between polls
// (x86 `pause`, Arm `yield`, else a scheduler yield), shared by the thread
// pool's workers and callers and by the quantised linear's row hand-off.
#pragma once

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define PAGEDSERVE_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define PAGEDSERVE_CPU_RELAX() asm volatile("yield")
#else
#include <thread>
#define PAGEDSERVE_CPU_RELAX() std::this_thread::yield()
#endif
