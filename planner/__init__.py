"""optplan subpackage."""
