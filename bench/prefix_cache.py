"""`pagedserve bench prefix-cache`, run from a checkout: the code is pagedserve/bench/prefix_cache.py."""
from pagedserve.bench.prefix_cache import main

if __name__ == "__main__":
    main()
