"""Scripts beside the test suite: `make fuzz` (fuzz_inputs.py) and `make faults` (fault_sweeps.py)."""
