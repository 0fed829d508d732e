"""Shared fixtures. jax runs on CPU with float32 matmuls at full precision."""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
