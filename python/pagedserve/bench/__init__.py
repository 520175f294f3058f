"""Benchmarks that ship with the package (``pagedserve bench NAME``, each also
``python -m pagedserve.bench.NAME``): throughput against Hugging Face
generate(), decode attention kernels, prefix caching, and a load generator for
any OpenAI-compatible server (serving). The repository's
bench/<name>.py scripts call these modules' main()."""
