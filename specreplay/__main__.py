"""`python -m specreplay ...` and `torchrun -m specreplay extract|score ...`."""

from specreplay.cli import main

if __name__ == "__main__":
    main()
