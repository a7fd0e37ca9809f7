"""The percentile of kvr's bench scripts (plot_bench.py, compare_ttft.py): numpy's default
(linear interpolation) percentile, without numpy. Scripts of this folder import it beside
them."""


def percentile(sorted_values, p):
    """The `p`-th percentile (0..100) of an ascending list; 0.0 of an empty one."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * p / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)
