"""`make bench` (`python -m bench`): specreplay's performance figures, one section per module
under bench/sections/, sharing bench/common.py. What each figure means, how it is measured and
the measured results: bench/README.md."""
