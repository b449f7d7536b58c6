"""The selective scan (Mamba-1): a diagonal state per channel and state index."""
