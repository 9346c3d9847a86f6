"""How every op takes log-gates: floored at ``LOG_GATE_MIN``.

exp() of anything below it is 0 in float32 and float64, so the floor changes no decay; it keeps
cumulative sums finite, where a gate of exactly 0 (log-gate -inf) would give ``-inf - -inf = nan`` in
their differences."""
LOG_GATE_MIN = -1e4
