"""``python -m pagedserve.cli``: the ``pagedserve`` command without its console script."""

from . import main

main()
