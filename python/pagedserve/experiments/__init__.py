"""Experiments that need no model: allocator fragmentation (fragmentation), the
scheduling-policy simulator over the real C++ scheduler (scheduler, with its
workload generator and fitted step-cost model), and the figures (plots)."""
