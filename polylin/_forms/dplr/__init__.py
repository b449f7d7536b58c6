"""The generalized delta rule (diagonal plus low rank): chunked, recurrent, quadratic."""
