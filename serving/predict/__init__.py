"""Small models (issue 20): synchronous predictions behind a dynamic batcher."""
