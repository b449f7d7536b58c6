"""polylin."""
