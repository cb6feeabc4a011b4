"""The planner's pure ring: observations in, decisions out (`Planner.decide`), with the sizing
model, the forecast and the benchmark's threshold peer. No I/O, no clock, no randomness."""
