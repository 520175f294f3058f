"""`pagedserve bench throughput`, run from a checkout: the code is pagedserve/bench/throughput.py."""
from pagedserve.bench.throughput import main

if __name__ == "__main__":
    main()
