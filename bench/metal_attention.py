"""`pagedserve bench metal-attention`, run from a checkout: the code is pagedserve/bench/metal_attention.py."""
from pagedserve.bench.metal_attention import main

if __name__ == "__main__":
    main()
