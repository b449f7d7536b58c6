"""Linear attention, with or without a decay: chunked, recurrent and quadratic forms."""
