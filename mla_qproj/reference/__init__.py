"""Pure-PyTorch reference of the SPEC: the oracle of the tests and the CPU backend."""
