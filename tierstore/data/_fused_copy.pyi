"""Types of the C extension module built from fused_copy.c (see its ``walk``)."""

def walk(
    lo: int,
    at: int,
    digests: int,
    n_shards: int,
    spans: int,
    n_spans: int,
    refs: int,
    n_refs: int,
    ids: int,
    n_ids: int,
    gather: bool,
    streaming: bool,
    hashing: bool,
    state: int,
    reset: int,
    update: int,
    digest: int,
    /,
) -> int: ...
