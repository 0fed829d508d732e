"""python -m serve: the OpenAI-compatible server."""

import sys

from serve.http.main import main

sys.exit(main())
