"""python -m jaxinfra"""

import sys

from jaxinfra.cli import main

sys.exit(main())
