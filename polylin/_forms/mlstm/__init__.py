"""The mLSTM (xLSTM's matrix memory): recurrent, chunked and quadratic forms."""
