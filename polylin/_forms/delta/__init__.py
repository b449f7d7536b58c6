"""The delta rule and the gated delta rule: chunked, recurrent and quadratic forms."""
