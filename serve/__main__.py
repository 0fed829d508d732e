"""python -m serve: the OpenAI-compatible server."""

import sys

from serve.api_server import main

sys.exit(main())
