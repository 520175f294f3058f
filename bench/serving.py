"""`pagedserve bench serving`, run from a checkout: the code is pagedserve/bench/serving.py."""
from pagedserve.bench.serving import main

if __name__ == "__main__":
    main()
