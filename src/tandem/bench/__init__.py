"""Layer 5: benchmarks. Each is a command (`tandem bench NAME --json`) that measures against a baseline run in
the same process tree and prints one JSON object."""
