"""`pagedserve bench routing`, run from a checkout: the code is pagedserve/bench/routing.py."""
from pagedserve.bench.routing import main

if __name__ == "__main__":
    main()
