"""What the chunked forms of every family share."""
