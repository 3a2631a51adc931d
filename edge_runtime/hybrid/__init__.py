"""The hybrid runtime: router, difficulty score, device state, the one ordered stream and its hand-offs."""
