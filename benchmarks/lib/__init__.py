"""What the benchmarks share that is no product code: argparse types (`args`), the statistics
their goals are decided with (`stats`)."""
