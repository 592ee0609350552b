"""What is refused at the edge: numeric ranges of recipe values, JSON files through pydantic,
non-finite numbers before they reach a cache or checkpoint."""
