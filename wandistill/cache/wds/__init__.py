"""webdataset backend: POSIX tar shards, one `<key>.json` + `<key>.safetensors` pair per record.

Shards are written with `webdataset.TarWriter` (no encoder: we hand it bytes, so nothing is ever
pickled; the `.safetensors` member is streamed by its tarfile from the header and each tensor's
own bytes, never serialised into one blob first) into a temp name, fsynced and renamed. Because
every member name is short and the tar format is USTAR, member data offsets are computable; we
record each record's safetensors offset and length in the manifest so the training reader can
`pread` one recorded step directly instead of streaming the tar. Stock `webdataset.WebDataset`
still reads these shards unchanged.

Checksums (no silent wrong tensors), each byte hashed once. The training reader `pread`s one
step's rows, so a whole-shard sha256 cannot guard it. Each record's safetensors header carries,
in its `__metadata__`, the record key and a crc32c of every tensor (one per row of the leading
step axis for step fields: x_t, teacher output, timesteps, features); the manifest entry's
`crc32c` lists, per record, the crc32c of that header (8-byte length prefix + JSON) and of the
`.json` member; its `frame_sha256` hashes every other byte of the tar: headers,
padding and members outside the tensor data.
Every read verifies the header against the manifest, then each tensor or row it returns against
the header (crc32c runs at ~13 GB/s). Caches written before these checksums existed carry neither
and are read unverified, as before. `verify` also walks the tar headers: any member that is not
`<listed key>.json` / `<listed key>.safetensors` (a `.pth`, a `../` path, a link) is reported.

Reading with stock webdataset: use `safe_decoder()` (`.decode(safe_decoder())` or
`.map(safe_decoder())`), never webdataset's default handlers, which unpickle `.pth`/`.pyd`.
"""
