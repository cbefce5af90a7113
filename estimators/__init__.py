"""optplan.estimators: pure, torch-free estimators over frozen pydantic types.

Nothing in this package imports torch or textual, performs I/O beyond reading its own packaged data
files, or holds mutable global state.
"""
