"""Where bytes go: storage locations (local or fsspec URL), atomic writes, owned output folders,
model folders read as safetensors only."""
