"""Experiments that need no model: allocator fragmentation (and, later, scheduling policies)."""
