"""References the benchmarks and tests compare against (Hugging Face generate())."""
