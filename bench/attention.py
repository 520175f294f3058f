"""`pagedserve bench attention`, run from a checkout: the code is pagedserve/bench/attention.py."""
from pagedserve.bench.attention import main

if __name__ == "__main__":
    main()
