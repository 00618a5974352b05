"""What the benchmarks share that is no product code: argparse types (`args`)."""
