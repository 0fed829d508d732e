"""A separate process (as a prefill engine is): offer blocks [6, 1, 3] of a bf16 and an int8 pool in
shared memory and print the handles as JSON, then exit (the segments outlive it until pulled)."""

import json

from serve.kv_transfer.shm_transport import write_blocks
from tests.kv_transfer.pools import random_pool

print(json.dumps({kind: write_blocks(random_pool(kind, 0), [6, 1, 3]).to_params() for kind in ("bf16", "int8")}))
