"""Layer 5: the `tandem` command."""
