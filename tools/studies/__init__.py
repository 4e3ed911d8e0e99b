"""One-off studies: each answered a question once (its file in benchmarks/ is the record); not benchmarks."""
