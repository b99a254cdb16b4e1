"""Data: the shapes generator (:mod:`.synth`), source formats (:mod:`.sources`), the Parquet
shard format and builder (:mod:`.shards`) and Ray Data ingest into training (:mod:`.ingest`)."""
